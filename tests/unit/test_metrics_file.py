"""metrics.jsonl after a write that was cut off (a full disk mid-append): the resume sets the cut-off record aside
so the next record starts its own line, steps logged again after a resume are marked, and `doctor --run` names a
damaged line by file and line instead of stopping at it."""
from __future__ import annotations

import json

from tests.inprocess import cli
from trainer.distributed.runtime import DistInfo
from trainer.engine.logging import MetricsWriter, read_metrics, repair_metrics

RECORDS = [dict(split="train", epoch=0, step=s, loss=1.0 / s) for s in (1, 2, 3)]


def write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_a_cut_off_last_record_is_set_aside_and_the_last_step_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, RECORDS, b'{"split": "train", "epoch": 0, "st')
    assert repair_metrics(path) == 3
    assert path.read_bytes().endswith(b"\n") and len(read_metrics(tmp_path)) == 3
    assert (tmp_path / "metrics.jsonl.damaged").read_text() == '{"split": "train", "epoch": 0, "st\n'


def test_a_resumed_writer_marks_the_steps_it_logs_again(tmp_path):
    write(tmp_path / "metrics.jsonl", RECORDS, b'{"split": "tr')
    writer = MetricsWriter(tmp_path, DistInfo(), tensorboard=False, purge_step=3)   # resumed at step 2
    for step in (3, 4):
        writer.write("train", 0, step, dict(loss=0.5))
    rows = read_metrics(tmp_path)
    assert [(r["step"], r.get("redone", False)) for r in rows] == [(1, False), (2, False), (3, False), (3, True),
                                                                  (4, False)]


def test_doctor_names_a_damaged_line_by_file_and_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in RECORDS]
    lines[1] = lines[1][:20] + lines[2]                    # a cut-off record joined to the next (before issue 68)
    (run / "metrics.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    report = cli("doctor", "--run", str(run)).stdout
    assert f"{run / 'metrics.jsonl'}:2: not a JSON record" in report and "2 records" in report


def test_a_checkpoint_of_other_versions_is_resumed_with_a_note(tmp_path):
    from trainer.engine import ckpt_io
    now = ckpt_io.versions()
    assert ckpt_io.version_changes(now) == [] and ckpt_io.version_changes(None) == []
    older = dict(now, torch="2.11.0", trainer="0.9")
    note = ckpt_io.version_changes(older)[0]
    assert f"torch 2.11.0 -> {now['torch']}" in note and f"trainer 0.9 -> {now['trainer']}" in note
    assert "bitwise" in note

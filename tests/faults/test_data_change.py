"""Issue 57 item 3: a run knows its data. Every checkpoint records the data's fingerprint (per file its size and
content hash, remembered under path, size, mtime and inode; the recipe's counts); a resume on other data is
refused in one line naming the file and what differs, unless --allow-data-change, which logs it as changed on
resume; `trainer doctor --run` shows it."""
from __future__ import annotations

import json
import time

from bench.opcount import epoch_loop_for
from tests.conftest import record_fault
from tests.faults.conftest import ARGS, write_udata
from tests.inprocess import cli
from trainer.data.fingerprint import data_changes, data_fingerprint, files_under
from trainer.engine.checkpointer import data_of
from trainer.engine.ckpt_io import load
from trainer.engine.logging import read_metrics
from trainer.launch.exitcodes import USAGE


def test_every_checkpoint_records_the_datas_fingerprint(trained):
    ckpt = load(trained / "run" / "checkpoints" / "final.pt")
    data = ckpt["data"]
    assert list(data["files"]) == ["u.data"]
    assert data["files"]["u.data"]["size"] == (trained / "data" / "u.data").stat().st_size
    lines = len((trained / "data" / "u.data").read_text().splitlines())
    assert data["counts"] == {"users": 60, "items": 80, "interactions": lines}


def test_a_resume_on_other_data_of_the_same_counts_is_refused_and_allowed_with_the_flag(trained, tmp_path):
    import shutil
    shutil.copytree(trained / "run", tmp_path / "run")
    shutil.copytree(trained / "data", tmp_path / "data")
    udata = tmp_path / "data" / "u.data"
    lines = udata.read_text().splitlines(keepends=True)
    # the same users, items and interactions, other ratings: what "continues silently" meant
    udata.write_text("".join(line.replace("\t1\t", "\t4\t", 1) if k % 2 else line for k, line in enumerate(lines)))
    t0 = time.monotonic()
    proc = cli("train", *ARGS, f"data.path={tmp_path / 'data'}", "--epochs", "2", "--run-dir",
                   str(tmp_path / "run"), "--resume", "auto", check=False)
    exit_s = time.monotonic() - t0
    assert proc.returncode == USAGE, proc.stderr[-2000:]
    error = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(error) == 1 and "the data differs from the data it trained on: u.data: same size, other content" \
        in error[0], proc.stderr[-2000:]
    assert "--allow-data-change" in proc.stderr
    record_fault("resume on other data of the same counts (u.data ratings changed)", exit_s=round(exit_s, 2),
                 steps_lost=0, outcome="exit 2 naming the file and what differs; --allow-data-change goes on, "
                 "logged as changed on resume")
    proc = cli("train", *ARGS, f"data.path={tmp_path / 'data'}", "--epochs", "2", "--run-dir",
                   str(tmp_path / "run"), "--resume", "auto", "--allow-data-change")
    assert "data changed on resume: u.data: same size, other content" in proc.stderr
    assert any("data changed on resume" in json.dumps(r) for r in read_metrics(tmp_path / "run", "resume"))
    report = cli("doctor", "--run", str(tmp_path / "run")).stdout
    assert "u.data" in report and "unchanged" in report           # the new checkpoints record the new data


def test_a_resume_on_fewer_rows_names_the_size_and_the_counts(tmp_path):
    write_udata(tmp_path / "data" / "u.data")
    cli("train", *ARGS, f"data.path={tmp_path / 'data'}", "--epochs", "1", "--run-dir", str(tmp_path / "run"))
    write_udata(tmp_path / "data" / "u.data", per_user=20)          # the file the checkpoint was trained on
    proc = cli("train", *ARGS, f"data.path={tmp_path / 'data'}", "--epochs", "2", "--run-dir",
                   str(tmp_path / "run"), "--resume", "auto", check=False)
    assert proc.returncode == USAGE
    assert "u.data: " in proc.stderr and " bytes" in proc.stderr and "interactions " in proc.stderr
    report = cli("doctor", "--run", str(tmp_path / "run")).stdout
    assert "changed: " in report and "bytes" in report


def test_the_counts_of_every_recipe():
    for recipe, keys in (("kgat", {"users", "items", "entities", "relations", "interactions", "triples"}),
                         ("har", {"classes", "training_cases"}), ("sasrec", {"users", "items", "interactions"})):
        tr, _ = epoch_loop_for(recipe, [])
        data = data_of(tr.run)
        assert set(data["counts"]) == keys and all(v > 0 for v in data["counts"].values()), (recipe, data)
        assert data["files"] == {}                                  # generated data: no file


def test_fingerprints_name_files_under_data_path_and_skip_hidden_ones(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("1\n")
    (tmp_path / "sub" / "b.txt").write_text("2\n")
    (tmp_path / ".frame-cache").mkdir()
    (tmp_path / ".frame-cache" / "c.npy").write_text("x")
    files = files_under(tmp_path)
    assert [f.name for f in files] == ["a.txt", "b.txt"]
    memo = tmp_path / ".memo"
    first = data_fingerprint(files, {"users": 2}, tmp_path, memo)
    assert set(first["files"]) == {"a.txt", "sub/b.txt"}
    assert any(memo.iterdir())                                      # remembered: a warm start reads no file
    (tmp_path / "a.txt").write_text("3\n")                          # same size, other content
    second = data_fingerprint(files, {"users": 3}, tmp_path, memo)
    assert data_changes(first, second) == ["a.txt: same size, other content (sha256 "
                                           f"{first['files']['a.txt']['sha256'][:12]} -> "
                                           f"{second['files']['a.txt']['sha256'][:12]})", "users 2 -> 3"]
    assert data_changes(None, second) == [] and data_changes(first, first) == []

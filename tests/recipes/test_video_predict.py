"""Issue 72, video: `trainer predict` labels every frame of every video, first and last included, in the layout of
the training labels (read back by the training's own labels.csv reader); the test videos' labelled frames get the
labels whose accuracy `trainer eval` reports (the same clips, the same model); new videos from a folder; a video
without frames stops with one line."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from tests.inprocess import cli
from trainer.recipes.video import data as D

pytestmark = pytest.mark.long      # several launches of the trainer: make test-fast leaves it out

SMALL = ("--recipe", "video", "model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4",
         "data.synthetic_frames=30", "train.num_workers=0", "train.batch_size=4", "data.val_videos=[synth02.mp4]",
         "data.test_videos=[synth03.mp4]")


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_video_labels_every_frame_in_the_training_layout(tmp_path):
    cache, run = tmp_path / "synth", tmp_path / "run"
    cli("train", *SMALL, "--epochs", "1", "log.tensorboard=false", f"data.cache={cache}", "--run-dir",
            str(run))
    out = tmp_path / "labels.csv"
    cli("predict", "--checkpoint", str(run), "--out", str(out), "--part-size", "50")
    rows = read(out)
    videos = sorted({r["video"] for r in rows})
    assert len(videos) == 4 and len(rows) == 4 * 30
    for v in videos:
        assert [int(r["frame"]) for r in rows if r["video"] == v] == list(range(30))      # first and last too
    names = [k[2:] for k in rows[0] if k.startswith("p_")]
    assert all(abs(sum(float(r[f"p_{n}"]) for n in names) - 1) < 1e-5 for r in rows)
    labels, classes = D.read_generic(out, names)                        # the training's reader takes it back
    assert sum(len(a.frames) for a in labels) == len(rows) and classes == names
    # the test split's labelled frames: as accurate as eval says
    cli("eval", "--checkpoint", str(run), "--splits", "test", "--out", str(tmp_path / "eval.json"))
    report = json.loads((tmp_path / "eval.json").read_text())["test"]
    truth = {(r["video"], r["frame"]): r["label"] for r in read(cache / "labels.csv")}
    test = [r for r in rows if (r["video"], r["frame"]) in truth and r["video"] == "synth03.mp4"]
    assert len(test) == report["cases"], (len(test), report)
    assert abs(np.mean([r["label"] == truth[(r["video"], r["frame"])] for r in test]) - report["accuracy"]) < 1e-9
    # a video without frames
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "empty.mp4").write_bytes(b"not a video")
    bad = cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "bad.csv"), "--data",
                  str(tmp_path / "bad"), check=False)
    assert bad.returncode == 2 and "empty.mp4" in bad.stderr and bad.stderr.strip().splitlines()[-1].startswith(
        "error:"), bad.stderr[-2000:]


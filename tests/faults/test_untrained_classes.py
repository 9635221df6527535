"""Issue 57: a class declared in both .ts headers but present only in the test file is named in a warning at start,
recorded in RUN_DIR/data.json and in the evaluations (no_training_case); data.require_all_classes=true refuses it."""
import json

import numpy as np

from tests.inprocess import cli
from trainer.engine.logging import read_metrics

HEADER = "@problemName toy\n@univariate true\n@equalLength true\n@seriesLength 8\n@classLabel true a b c\n@data\n"


def write(folder, rng):
    folder.mkdir()
    def cases(labels):
        return "".join(",".join(f"{v:.3f}" for v in rng.normal(size=8) + k) + f":{c}\n"
                       for k, c in enumerate(labels))
    (folder / "toy_TRAIN.ts").write_text(HEADER + cases(["a", "b"] * 6))          # no case of c
    (folder / "toy_TEST.ts").write_text(HEADER + cases(["a", "b", "c"] * 3))
    return folder


def test_a_class_only_in_the_test_file_is_named_recorded_and_refusable(tmp_path):
    data = write(tmp_path / "ts", np.random.default_rng(0))
    run = tmp_path / "run"
    common = ("train", "--recipe", "har", "--epochs", "1", f"data.path={data}", "data.val_fraction=0",
              "data.cache=off", "--batch-size", "4", "log.tensorboard=false")
    out = cli(*common, "--run-dir", str(run))
    assert "class(es) with no training case: c: the model cannot learn them" in out.stderr
    record = json.loads((run / "data.json").read_text())
    assert record == dict(classes=["a", "b", "c"], train_cases=[6, 6, 0], no_training_case=["c"])
    test = read_metrics(run, "test")
    assert test and all(r["no_training_case"] == ["c"] for r in test)
    out = cli(*common, "data.require_all_classes=true", "--run-dir", str(tmp_path / "strict"), check=False)
    assert out.returncode == 2 and "class(es) with no training case: c (of 3 declared)" in out.stderr
    assert "data.require_all_classes=false" in out.stderr

"""Issue 72, HAR: `trainer predict` labels every window: probabilities that sum to 1, the label their argmax, the
test split's labels as accurate as `trainer eval` says (the same windows, the same model), and an unlabeled `.ts`
file of new recordings (`@classLabel false`) given the same labels as the same cases with theirs."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from tests.inprocess import cli
from trainer.recipes.har import data as D

pytestmark = pytest.mark.long      # several launches of the trainer: make test-fast leaves it out

SMALL = ("data.synthetic_cases=160", "data.synthetic_channels=3", "data.synthetic_length=32", "data.cache=off")


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_ts(path, cases: np.ndarray) -> None:
    """Cases [N, C, T] as a UEA .ts file without labels."""
    n, c, t = cases.shape
    lines = ["@problemName new", "@timeStamps false", "@univariate false", f"@dimensions {c}", "@equalLength true",
             f"@seriesLength {t}", "@classLabel false", "@data"]
    lines += [":".join(",".join(repr(float(v)) for v in channel) for channel in case) for case in cases]
    path.write_text("\n".join(lines) + "\n")


def test_har_labels_every_window_as_eval_scores_them(tmp_path):
    run = tmp_path / "run"
    cli("train", "--recipe", "har", *SMALL, "--epochs", "2", "log.tensorboard=false", "--run-dir", str(run))
    cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "all.csv"), *SMALL)
    rows = read(tmp_path / "all.csv")
    names = [k[2:] for k in rows[0] if k.startswith("p_")]
    for r in rows:
        p = [float(r[f"p_{n}"]) for n in names]
        assert abs(sum(p) - 1) < 1e-5 and r["label"] == names[int(np.argmax(p))]
    test = [r for r in rows if r["split"] == "test"]
    cli("eval", "--checkpoint", str(run), "--splits", "test", "--out", str(tmp_path / "eval.json"), *SMALL)
    accuracy = json.loads((tmp_path / "eval.json").read_text())["test"]["accuracy"]
    assert len(test) > 0 and abs(np.mean([r["label"] == r["true_label"] for r in test]) - accuracy) < 1e-9
    # new recordings without labels: the first test cases again, as a .ts file
    raw = D.synthesize(160, 3, 32, 6)
    from trainer.recipes.har.prepare import _holdout
    cases = _holdout(raw, 0.25, "test", seed=1)["test"]
    x = np.stack(cases.samples[:7])
    write_ts(tmp_path / "new.ts", x)
    cli("predict", "--checkpoint", str(run), "--out", str(tmp_path / "new.csv"), "--data",
            str(tmp_path / "new.ts"), *SMALL)
    new = read(tmp_path / "new.csv")
    assert "true_label" not in new[0] and [r["case"] for r in new] == [str(i) for i in range(7)]
    assert [r["label"] for r in new] == [r["label"] for r in test[:7]]
    assert np.allclose([float(r[f"p_{names[0]}"]) for r in new], [float(r[f"p_{names[0]}"]) for r in test[:7]],
                       atol=1e-5)

"""bench/sasrec_beauty.py on a small generated `user item` file in Beauty's layout (the real set is not shipped):
every run's report row, its curve and the paper's figures beside it; a missing file and an unknown run refused."""
import json
import subprocess

import numpy as np
import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # two short trainings: make test-fast leaves it out


def pairs_file(path, users=150, items=300, seed=0):
    rng = np.random.default_rng(seed)
    lines = [f"{u} {i}" for u in range(1, users + 1) for i in rng.integers(1, items + 1, rng.integers(5, 12))]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_beauty_bench_reports_each_run_beside_the_paper(tmp_path):
    data = pairs_file(tmp_path / "beauty.txt")
    proc = subprocess.run([PY, "-m", "bench.sasrec_beauty", "--data", str(data), "--runs", "bce,bce_before",
                           "--epochs", "2", "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "sasrec_beauty.json").read_text())
    bce, before = report["runs"]
    assert (bce["run"], before["run"]) == ("bce", "bce_before")
    assert (bce["paper_full_hr10"], bce["paper_full_ndcg10"]) == (0.0246, 0.0126)
    assert before["paper_full_ndcg10"] == 0.0126 and "model.init=xavier" in before["overrides"]
    for run in (bce, before):
        assert [e for e, _ in run["val_curve"]] == [1, 2] and 1 <= run["best_epoch"] <= 2
        assert 0 <= run["test_full_ndcg10"] <= run["test_full_hr10"] <= 1 and run["epoch_time_s"] > 0
    assert (tmp_path / "out" / "sasrec_beauty.png").stat().st_size > 0
    config = (tmp_path / "out" / "runs" / "beauty-bce-seed0" / "config.yaml").read_text()
    assert "init: normal" in config and "norm: original" in config and "positions: from_start" in config
    # another seed joins the report (--update) as a row of its own; the seed-0 rows stay as they were
    proc = subprocess.run([PY, "-m", "bench.sasrec_beauty", "--data", str(data), "--runs", "bce", "--seed", "1",
                           "--epochs", "1", "--update", "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "out" / "sasrec_beauty.json").read_text())["runs"]
    assert [(r["run"], r["seed"]) for r in again] == [("bce", 0), ("bce", 1), ("bce_before", 0)]
    assert again[0] == bce and again[1]["epochs_run"] == 1 and again[1]["device"] == "cpu"
    assert "bce seed 1" in proc.stdout
    assert "seed: 1" in (tmp_path / "out" / "runs" / "beauty-bce-seed1" / "config.yaml").read_text()


def test_beauty_bench_refuses_a_missing_file_and_an_unknown_run(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.sasrec_beauty", "--data", str(tmp_path / "none.txt")], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "none.txt not found" in proc.stdout
    proc = subprocess.run([PY, "-m", "bench.sasrec_beauty", "--runs", "bce,bec"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "unknown ['bec']" in proc.stderr

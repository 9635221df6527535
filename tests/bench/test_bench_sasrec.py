"""bench/sasrec.py smoke run (2 epochs, SASRec and SASRec+mHC) and bench/sasrec_profile.py: JSON and PNG
written, the ratios and the profile's parts consistent; no timing targets asserted."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out

ML100K = REPO.parent / "shared" / "data" / "ml-100k"


def test_sasrec_bench_smoke(tmp_path):
    # generated data (120 users) rather than ml-100k at maxlen 200: the harness is what is tested here, and
    # two variants on the real data cost CI ~20 s more (make bench-recipes runs the real thing)
    data = tmp_path / "synth"
    cli("data", "synth", "sasrec", "--out", str(data), "--users", "120")
    proc = subprocess.run([PY, "-m", "bench.sasrec", "--data", str(data), "--epochs", "2", "--variants",
                           "sasrec,sasrec_mhc", "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "sasrec.json").read_text())
    result, mhc = report["results"]
    assert result["recipe"] == "sasrec" and result["epochs"] == 2 and len(result["epoch_times_s"]) == 2
    assert 0 <= result["test_best"]["ndcg10"] <= 1 and "full_ndcg@10" in result["test_best_full"]
    assert mhc["variant"] == "sasrec_mhc" and 1 <= mhc["mhc_sinkhorn_iters_mean"] <= 20
    ratios = report["epoch_time_ratios"]
    assert ratios["sasrec_mhc_vs_sasrec"] == round(mhc["epoch_time_s"] / result["epoch_time_s"], 3)
    assert ratios["sasrec_vs_reference"] == round(result["epoch_time_s"] / report["reference"]["epoch_time_s"], 3)
    assert ratios["sasrec_mhc_vs_sasrec_median"] == round(mhc["epoch_time_median_s"] / result["epoch_time_median_s"], 3)
    assert result["epoch_time_median_s"] == round(result["epoch_times_s"][1], 3)     # epochs 2.. (one here)
    assert (tmp_path / "out" / "sasrec.png").stat().st_size > 10_000
    assert "reference" in proc.stdout


@pytest.mark.timing       # "other"'s share is one of measured times: in a CPU share of its own beside the workers
def test_sasrec_profile_parts_add_up(tmp_path):
    # the median of 3 epochs (of about 0.5 s each): one epoch hit by a load spike (make test runs its cluster
    # half beside) once made "other" 64% of it instead of about 15%
    args = [PY, "-m", "bench.sasrec_profile", "--epochs", "3", "--out", str(tmp_path)]
    if not ML100K.exists():
        args += ["--data", ""]                          # generated data of ml-100k's size
    proc = subprocess.run(args, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sasrec_profile.json").read_text())
    parts = report["parts_s"]
    assert set(parts) == {"data", "embedding", "attention", "ffn", "loss", "optimizer", "other"}
    assert all(parts[k] > 0 for k in ("data", "embedding", "attention", "ffn", "loss", "optimizer"))
    assert report["parts_share"]["other"] < 0.6          # the replays account for most of the epoch
    # the estimate is the report's arithmetic on a matmul rate measured apart from the epochs (a load dip in either
    # moves it: 1.288 s against a 1.278 s epoch beside make test's workers); where it stands is the committed figures'
    assert report["limit_s"] > 0 and report["real_positions"] > 0
    assert abs(report["vs_limit"] - report["epoch_s"] / report["limit_s"]) <= 0.01
    assert (tmp_path / "sasrec_profile.png").stat().st_size > 10_000
    assert "estimated limit" in proc.stdout

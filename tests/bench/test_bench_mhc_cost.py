"""bench/mhc_cost.py smoke run: interleaved rounds, per-round ratios against the base model, JSON and PNG;
no timing target asserted (the README's figures come from the full run)."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_mhc_cost_bench_smoke(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.mhc_cost", "--data", "", "--rounds", "2", "--variants",
                           "sasrec,sasrec_mhc", "--out", str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "mhc_cost.json").read_text())
    times = report["epoch_s"]
    assert set(times) == {"sasrec", "sasrec_mhc"} and all(len(v) == 2 for v in times.values())
    ratio = report["ratios"]["sasrec_mhc"]
    assert ratio["vs"] == "sasrec" and "sasrec" not in report["ratios"]
    expected = sorted(a / b for a, b in zip(times["sasrec_mhc"], times["sasrec"]))     # of the rounded times
    assert all(abs(a - b) < 0.005 for a, b in zip(sorted(ratio["rounds"]), expected))
    assert ratio["range"] == [min(ratio["rounds"]), max(ratio["rounds"])]
    assert report["fused_kernels_built"] == (report["kernels_unavailable"] == "")
    assert (tmp_path / "mhc_cost.png").stat().st_size > 10_000
    assert "sasrec_mhc" in proc.stdout and "x sasrec" in proc.stdout


def test_mhc_cost_bench_rejects_an_unknown_variant(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.mhc_cost", "--variants", "sasrec,sasrek_mhc", "--out", str(tmp_path)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "sasrek_mhc" in proc.stderr and "sasrec_mhc" in proc.stderr

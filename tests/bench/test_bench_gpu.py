"""bench.gpu's plumbing on this CPU (--device cpu --tiny): every row and section runs and the JSON and PNG are
written; without CUDA the default command stops with a message, not a traceback. The figures are a GPU's
(make bench-gpu on one)."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_the_gpu_bench_runs_through_on_a_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--quick", "--out",
                           str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"sasrec-ml100k bf16", "sasrec-synthetic bf16"} & set(report["rows"])
    assert all(r["syncs"] == 0 and r["ops"] > 0 and r["step_ms"] > 0 for r in report["rows"].values())
    assert {r.split()[0] for r in report["rows"]} >= {"har", "kgat", "video"}
    assert report["video_bare"] and out.with_suffix(".png").stat().st_size > 1000
    stock = report["stock_sasrec"]                  # ours beside the stock SASRec, on the same device and data
    assert len(stock["epoch_s"]["stock"]) == len(stock["epoch_s"]["ours compile=off"]) == stock["epochs"] >= 2
    ratio = stock["median_epoch_s"]["ours compile=off"] / stock["median_epoch_s"]["stock"]   # of rounded medians
    assert abs(stock["ratio_ours_over_stock"]["off"] - ratio) < 0.01
    assert stock["batches"]["ours"] > 0 and stock["batches"]["stock"] > 0
    out.with_suffix(".png").unlink()                # the PNG drawn again from the JSON alone (a GPU machine's)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--plot", str(out)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 0 and out.with_suffix(".png").stat().st_size > 1000, proc.stderr[-2000:]


def test_without_cuda_it_says_so():
    if torch.cuda.is_available():
        return print("CUDA is here: the message for a machine without it is not shown")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "no CUDA device here" in proc.stdout and "Traceback" not in proc.stderr


def test_amps_add_a_deterministic_row_with_its_cost_and_the_rows_after_it_are_not_deterministic(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--quick", "--out", str(out),
                           "--only", "har,kgat", "--amps", "bf16,deterministic,fp32"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {f"{r} {a}" for r in ("har", "kgat") for a in ("bf16", "deterministic", "fp32")}, rows
    for r in ("har", "kgat"):
        assert rows[f"{r} deterministic"]["cost_over_bf16"] == round(rows[f"{r} deterministic"]["step_ms"]
                                                                     / rows[f"{r} bf16"]["step_ms"], 3)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--amps", "bf16,fp8"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "--amps bf16,fp8: each one of fp32, bf16, compiled, deterministic" in proc.stderr


def test_after_a_deterministic_row_torch_is_back_to_its_default_kernels(monkeypatch):
    from bench.gpu import nondeterministic_kernels
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # what deterministic_kernels sets: undone after
    from trainer.distributed.runtime import deterministic_kernels
    deterministic_kernels()
    assert torch.are_deterministic_algorithms_enabled()
    nondeterministic_kernels()
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic

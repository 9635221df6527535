"""bench/sasrec_at_size.py's plumbing on a CPU at a small shape (the GPU row is issue 70's device check:
bench/gpu_check.sh step 11): ours beside the stock model per batch size, every user of the test split evaluated
with full ranking, and the report joined to the one at --out, batch by batch."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_the_at_size_bench_joins_its_rows_to_the_report(tmp_path):
    out = tmp_path / "gpu-cpu.json"
    out.write_text(json.dumps({"rows": {"har bf16": {"step_ms": 1.0}}}))       # an earlier report's rows stay
    proc = subprocess.run([PY, "-m", "bench.sasrec_at_size", "--device", "cpu", "--rows", "30000", "--width", "16",
                           "--maxlen", "20", "--batches", "32,64", "--warmup", "2", "--work", str(tmp_path / "work"),
                           "--out", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["rows"] == {"har bf16": {"step_ms": 1.0}}
    at = report["sasrec_at_size"]
    assert at["rows"] == 30000 and at["settings"]["width"] == 16 and set(at["batches"]) == {"32", "64"}
    for batch, rows in at["batches"].items():
        ours, stock = rows["ours compile=off"], rows["stock"]
        assert set(rows) == {"ours compile=off", "stock", "ratio_ours_over_stock"}     # no compiled row on a CPU
        assert ours["steps"] > stock["steps"] > 0 and ours["epoch_s"] > 0 and stock["epoch_s"] > 0
        assert rows["ratio_ours_over_stock"]["off"] == pytest.approx(ours["epoch_s"] / stock["epoch_s"], abs=2e-3)
        assert ("eval_users" in ours) == (batch == "32")                    # evaluated once, after the first epoch
    first = at["batches"]["32"]["ours compile=off"]
    users = {line.split()[0] for line in (tmp_path / "work" / "u-30000.data").read_text().splitlines()}
    assert first["eval_users"] == len(users) > 100                          # every user of the generated file
    assert 0 <= first["test_full_ndcg10"] <= 1 and first["eval_s"] > 0
    assert at["first_build_s"] == at["batches"]["32"]["ours compile=off"]["built_s"]
    assert "generated 30," in proc.stdout and "batch 64 stock" in proc.stdout


def test_without_cuda_it_says_so_and_measures_nothing(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the refusal is for machines without one")
    proc = subprocess.run([PY, "-m", "bench.sasrec_at_size", "--out", str(tmp_path / "r.json")], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "no CUDA device here" in proc.stdout and not (tmp_path / "r.json").exists()

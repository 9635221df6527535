"""The straggler watch's CUDA path (marked gpu; bench/gpu_check.sh step 5): on a GPU each rank's own time per step
is its logging window's CUDA-event time less what it waited in the gradient all-reduce, not the host clock's
(trainer/engine/window.py). Two ranks share the one GPU over gloo (as in test_cuda_resume.py), rank 1's host is
slowed for real (tests/conftest.py slowed_rank: one core beside busy loops), and rank 1 must be named: a slow host
starves its GPU, so the slowness shows in the GPU's timeline too.

Where torch sees no CUDA device the test is skipped with the reason printed, unless GPU_CHECK_ON_CPU=1: then it runs
on the CPU (the host clock's path: a plumbing check of the script, not of the CUDA path)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import launch_ranks, run_ended, slowed_rank, wait_all
from tests.distributed.test_stragglers import SLOWED, TWO_HOSTS, train_records
from tests.gpu.test_cuda_resume import DEVICE, PLACE, pytestmark  # noqa: F401 - the gpu mark and its skip
from tests.timeouts import limit
from trainer.distributed.stragglers import FACTOR


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to slow one rank against the other")
@pytest.mark.timing
def test_a_slowed_rank_sharing_the_gpu_is_named_from_its_cuda_time(tmp_path, busy_core_turn):
    run_dir = tmp_path / "run"
    # on a GPU 512 steps per rank: the GPU's share of a step is small, the slowed host's (~20 ms) makes the windows
    n_train = 16384 if torch.cuda.is_available() else 2048
    procs = launch_ranks(2, *SLOWED, f"data.n_train={n_train}", "--epochs", "1", "--run-dir", str(run_dir),
                         "dist.backend=gloo", "log.per_rank=true", "log.measure_sync=true", *PLACE,
                         **TWO_HOSTS)
    with slowed_rank(procs, rank=1, once=(run_dir / "metrics.jsonl").exists, until=run_ended(run_dir, 1)):
        results = wait_all(procs, timeout=limit("long"))
    assert [c for c, _ in results] == [0, 0], results[0][1][-3000:]
    log = (run_dir / "train.rank0.log").read_text()
    assert f"device={DEVICE}" in log, log[-2000:]                       # the ranks trained on the GPU
    judged = [(r["step"], r["slowest_rank"], r["slowest_factor"]) for r in train_records(run_dir)
              if "slowest_factor" in r]
    print("judged windows (step, slowest rank, factor):", judged)
    assert "straggler: rank 1 on nodeB took" in results[0][1], f"not named; the judged windows: {judged}"
    named = [r for r in train_records(run_dir) if "straggler_rank" in r]
    assert named[0]["straggler_factor"] >= FACTOR, named[0]

"""compile.step_graph=on on a CUDA device (issue 70 point 2; marked gpu, bench/gpu_check.sh step 12): the whole
optimizer step captured as CUDA graphs and replayed trains what the eager step trains, bit for bit under
train.deterministic=true (the same kernels, replayed), for SASRec (dropout, device-side negatives), HAR (the short
last batch: a second graph; classify's hits named again after each replay) and KGAT (a graph per phase, the sparse
rows' fixed-shape update, A^T's values refreshed in place after each epoch's attention).
tests/recipes/test_step_graph.py checks the same on a CPU, where the step is recorded and replayed instead of
captured.

Skipped with the reason printed where torch sees no CUDA device, unless GPU_CHECK_ON_CPU=1 (a plumbing check)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import assert_bitwise_equal, trainer, weights
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

ON_CPU = os.environ.get("GPU_CHECK_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU),
    reason="no CUDA device here (torch.cuda.is_available() is False): run on a GPU node "
           "(bench/gpu_check.sh step 12), or GPU_CHECK_ON_CPU=1 for a plumbing check on the CPU")]
RUNS = {
    "sasrec": ["--recipe", "sasrec", "--seed", "2", "model.time=false", "model.mhc=false", "data.maxlen=50",
               "train.max_steps=12"],
    "har": ["--recipe", "har", "--seed", "3", "--epochs", "3"],
    # two phases (a graph each), sparse rows in fixed shapes, the attention refreshed between the epochs
    "kgat": ["--recipe", "kgat", "--seed", "2", "--epochs", "2", "train.batch_size=256"],
}


@pytest.mark.parametrize("recipe", sorted(RUNS))
def test_the_graphed_step_trains_what_the_eager_step_trains(tmp_path, recipe):
    common = [*RUNS[recipe], "train.gpu_path=on", "log.tensorboard=false", "train.deterministic=true",
              "train.amp=bf16" if torch.cuda.is_available() else "train.amp=off"]
    logs = {}
    for mode in ("off", "on"):
        logs[mode] = trainer("train", *common, f"compile.step_graph={mode}", "--run-dir", str(tmp_path / mode),
                             timeout=limit("long")).stderr
    assert "captured after" in logs["on"], logs["on"][-3000:]
    print(f"{recipe}: " + "; ".join(line.split("] ", 1)[-1] for line in logs["on"].splitlines()
                                    if "step graph" in line))
    assert_bitwise_equal(weights(tmp_path / "on"), weights(tmp_path / "off"))
    losses = {m: [(r["step"], r.get("loss"), r.get("accuracy")) for r in read_metrics(tmp_path / m, "train")]
              for m in logs}
    assert losses["on"] == losses["off"]

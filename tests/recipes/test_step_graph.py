"""train.step_graph=on (issue 70 point 2) on this CPU: the whole optimizer step is recorded and replayed from the
graph's own inputs, which is everything a CUDA graph needs but the capture itself (bench/gpu_check.sh measures that
on a GPU). The run computes what it computes without the graph, bit for bit (the eager warm-up steps, the replays, the
short last batch's own graph), its checkpoints resume with or without it, and what it cannot capture is refused by
name before the first step."""
from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import assert_bitwise_equal, trainer, weights
from trainer.engine.logging import read_metrics
from trainer.engine.recipe import map_tensors
from trainer.engine.step_graph import WARMUP, copy_into, plain_state, shape_key

HAR = ("--recipe", "har", "--seed", "3", "--epochs", "3", "train.gpu_path=on", "train.tensorboard=false",
       "ckpt.every_steps=4", "ckpt.keep_last=0")


def train_rows(run_dir) -> list[tuple]:
    return [(r["split"], r["step"], r.get("loss"), r.get("accuracy")) for r in read_metrics(run_dir)
            if r["split"] in ("train", "val")]


@pytest.fixture(scope="module")
def har_runs(tmp_path_factory):
    """HAR three epochs of 5 steps (the fifth a short batch) without and with the graph."""
    root = tmp_path_factory.mktemp("har")
    logs = {}
    for mode in ("off", "on"):
        logs[mode] = trainer("train", *HAR, f"train.step_graph={mode}", "--run-dir", str(root / mode)).stderr
    return root, logs


def test_a_graphed_run_equals_the_eager_one_bit_for_bit(har_runs):
    root, logs = har_runs
    assert_bitwise_equal(weights(root / "on"), weights(root / "off"))
    # the losses and the training accuracy (classify's hits: a step's output the graph names again after a replay)
    assert train_rows(root / "on") == train_rows(root / "off")
    assert any(r[3] is not None and r[0] == "train" for r in train_rows(root / "on"))
    log = logs["on"]
    # the full batch is warm after WARMUP steps and replayed from then on; the short last one (once an epoch) is
    # captured in the epoch after its WARMUP-th
    assert log.count("captured after") == 2, log[-3000:]
    assert "step graph: batch shape [64x9x128, 64, 64] captured after" in log
    replays = [int(x) for x in re.findall(r"(\d+) replayed step\(s\) \(epoch", log)]
    assert replays == [5 - 1 - WARMUP, 2 * (5 - 1) - WARMUP, 3 * (5 - 1) - WARMUP + 1], log[-3000:]
    assert "step graph" not in logs["off"]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_graphed_runs_checkpoint_resumes_with_or_without_the_graph(har_runs, tmp_path, mode):
    root, _ = har_runs
    ckpt = root / "on" / "checkpoints" / "step-00000008.pt"
    saved = torch.load(ckpt, weights_only=True)["optimizer"]["param_groups"][0]
    assert isinstance(saved["lr"], float) and not saved.get("capturable")     # as a run without the graph writes it
    trainer("train", *HAR, f"train.step_graph={mode}", "--run-dir", str(tmp_path / "run"), "--resume", str(ckpt))
    assert_bitwise_equal(weights(tmp_path / "run"), weights(root / "off"))


def test_sasrec_with_dropout_and_its_negatives_equals_the_eager_run(tmp_path):
    args = ("--recipe", "sasrec", "--seed", "1", "--epochs", "1", "train.gpu_path=on", "model.time=false",
            "model.mhc=false", "data.maxlen=50", "train.tensorboard=false", "train.max_steps=6")
    for mode in ("off", "on"):
        trainer("train", *args, f"train.step_graph={mode}", "--run-dir", str(tmp_path / mode))
    assert_bitwise_equal(weights(tmp_path / "on"), weights(tmp_path / "off"))


@pytest.mark.parametrize("args, says", [
    (("--recipe", "har", "train.gpu_path=on", "train.grad_accum_steps=2"),
     "train.grad_accum_steps=2: the graph is one whole optimizer step; set it to 1"),
    (("--recipe", "har", "train.gpu_path=off"), "it needs the GPU-shaped step"),
    (("--recipe", "kgat", "train.gpu_path=on"), "the recipe's own optimizer"),
    (("--recipe", "har", "train.gpu_path=on", "train.compile=reduce-overhead"),
     "train.compile=reduce-overhead makes CUDA graphs of its own"),
])
def test_what_cannot_be_captured_is_refused_before_the_first_step(tmp_path, args, says):
    proc = trainer("train", *args, "--epochs", "1", "train.step_graph=on", "train.tensorboard=false", "--run-dir",
                   str(tmp_path / "run"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"train.step_graph=on: {says}" in proc.stderr, proc.stderr[-3000:]
    assert not list((tmp_path / "run").glob("checkpoints/*.pt"))


def test_shape_keys_inputs_and_saved_state():
    a = {"x": torch.zeros(4, 3), "y": (torch.zeros(4, dtype=torch.long), 7)}
    assert shape_key(a) == shape_key({"x": torch.ones(4, 3), "y": (torch.ones(4, dtype=torch.long), 7)})
    assert shape_key(a) != shape_key({"x": torch.ones(3, 3), "y": (torch.ones(3, dtype=torch.long), 7)})
    assert shape_key(a) != shape_key({"x": torch.ones(4, 3), "y": (torch.ones(4, dtype=torch.long), 8)})
    static = map_tensors(a, torch.clone)
    copy_into(static, {"x": torch.full((4, 3), 2.0), "y": (torch.arange(4), 7)})
    assert static["x"].eq(2).all() and static["y"][0].tolist() == [0, 1, 2, 3] and a["x"].eq(0).all()
    state = {"state": {}, "param_groups": [{"lr": torch.tensor(0.25, dtype=torch.float64), "capturable": True}]}
    assert plain_state(state)["param_groups"] == [{"lr": 0.25, "capturable": False}]
    phased = {"phase": "cf", "phases": {"cf": {"state": {}, "param_groups": [{"lr": 0.1}]}}}     # KGAT's layout
    assert plain_state(phased) == {"phase": "cf", "phases": {"cf": {"state": {}, "param_groups": [{"lr": 0.1}]}}}

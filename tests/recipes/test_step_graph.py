"""compile.step_graph=on (issue 70 point 2) on this CPU: the whole optimizer step is recorded and replayed from the
graph's own inputs, which is everything a CUDA graph needs but the capture itself (bench/gpu_check.sh measures that
on a GPU). The run computes what it computes without the graph, bit for bit (the eager warm-up steps, the replays, the
short last batch's own graph), its checkpoints resume with or without it, and what it cannot capture is refused by
name before the first step."""
from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import assert_bitwise_equal, weights
from tests.inprocess import cli
from trainer.engine.logging import read_metrics
from trainer.engine.recipe import map_tensors
from trainer.engine.step_graph import WARMUP, copy_into, plain_state, shape_key

HAR = ("--recipe", "har", "--seed", "3", "--epochs", "3", "train.gpu_path=on", "log.tensorboard=false",
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
        logs[mode] = cli("train", *HAR, f"compile.step_graph={mode}", "--run-dir", str(root / mode)).stderr
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
    cli("train", *HAR, f"compile.step_graph={mode}", "--run-dir", str(tmp_path / "run"), "--resume", str(ckpt))
    assert_bitwise_equal(weights(tmp_path / "run"), weights(root / "off"))


def test_sasrec_with_dropout_and_its_negatives_equals_the_eager_run(tmp_path):
    args = ("--recipe", "sasrec", "--seed", "1", "--epochs", "1", "train.gpu_path=on", "model.time=false",
            "model.mhc=false", "data.maxlen=50", "log.tensorboard=false", "train.max_steps=6")
    for mode in ("off", "on"):
        cli("train", *args, f"compile.step_graph={mode}", "--run-dir", str(tmp_path / mode))
    assert_bitwise_equal(weights(tmp_path / "on"), weights(tmp_path / "off"))


@pytest.mark.parametrize("args, says", [
    (("--recipe", "har", "train.gpu_path=on", "train.grad_accum_steps=2"),
     "train.grad_accum_steps=2: the graph is one whole optimizer step; set it to 1"),
    (("--recipe", "har", "train.gpu_path=off"), "it needs the GPU-shaped step"),
    (("--recipe", "har", "train.gpu_path=on", "compile.mode=reduce-overhead"),
     "compile.mode=reduce-overhead makes CUDA graphs of its own"),
])
def test_what_cannot_be_captured_is_refused_before_the_first_step(tmp_path, args, says):
    proc = cli("train", *args, "--epochs", "1", "compile.step_graph=on", "log.tensorboard=false", "--run-dir",
                   str(tmp_path / "run"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"compile.step_graph=on: {says}" in proc.stderr, proc.stderr[-3000:]
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
    phased = {"phase": "cf", "phases": {p: {"state": {}, "param_groups": [{"lr": torch.tensor(0.5, dtype=torch.float64),
                                                                        "capturable": True}]} for p in ("cf", "kg")}}
    assert plain_state(phased) == {"phase": "cf", "phases": {p: {"state": {}, "param_groups": [
        {"lr": 0.5, "capturable": False}]} for p in ("cf", "kg")}}                           # KGAT's layout


def test_a_recipes_own_optimizer_is_refused_unless_its_step_has_fixed_shapes():
    from types import SimpleNamespace

    from trainer.engine.optim import phased, sparse_rows
    from trainer.engine.step_graph import refusal
    params = [torch.nn.Parameter(torch.zeros(3))]
    run = SimpleNamespace(cfg=SimpleNamespace(compile=SimpleNamespace(mode="off")),
                          recipe=SimpleNamespace(gpu_shaped=True), info=SimpleNamespace(world_size=1),
                          wrapped=torch.nn.Linear(1, 1), accum=1, scaler=torch.amp.GradScaler("cpu", enabled=False))
    for optimizer, refused in ((torch.optim.RMSprop(params), True), (sparse_rows(torch.optim.Adam)(params), True),
                               (sparse_rows(torch.optim.Adam, fixed=True)(params), False),
                               (phased(sparse_rows(torch.optim.AdamW, fixed=True))(params, phases=("a", "b")), False),
                               (phased(torch.optim.AdamW)(params, phases=("a", "b")), False)):
        run.optimizer = optimizer
        why = refusal(run)
        assert (why is not None) == refused, (type(optimizer).__name__, why)
        if refused:
            assert why.startswith(f"the recipe's own optimizer ({type(optimizer).__name__}) is not capturable")


KGAT = ("--recipe", "kgat", "--seed", "2", "--epochs", "2", "train.gpu_path=on", "train.batch_size=512",
        "log.tensorboard=false", "ckpt.every_steps=10", "ckpt.keep_last=0")


def test_kgat_two_phases_sparse_rows_and_a_refreshed_attention_equal_the_eager_run(tmp_path):
    """KGAT on its GPU-shaped step: a graph per phase (CF 9 and KG 14 steps an epoch), the embedding rows by the
    fixed-shape update, the attention refreshed between the epochs (A^T's values follow it in place), the phases'
    loss sums added to in place; bit for bit the eager run, and its checkpoint (both phases' optimizer states,
    the learning rate a float) resumes without the graph to the same end. (One thread a process, as the tests
    run: KGAT's CPU products on several threads differ in the last bits from run to run, graph or not.)"""
    logs = {m: cli("train", *KGAT, f"compile.step_graph={m}", "--run-dir", str(tmp_path / m)).stderr
            for m in ("off", "on")}
    assert logs["on"].count("captured after") == 2, logs["on"][-3000:]
    assert "step graph: 2 graph(s), 42 replayed step(s) (epoch 2)" in logs["on"], logs["on"][-3000:]
    assert_bitwise_equal(weights(tmp_path / "on"), weights(tmp_path / "off"))
    kept = ("split", "epoch", "step", "loss", "lr", "cf_loss", "kg_loss")      # not the times and rates
    rows = {m: [{k: v for k, v in r.items() if k in kept or "@" in k} for r in read_metrics(tmp_path / m)]
            for m in logs}
    assert rows["on"] == rows["off"] and any("kg_loss" in r for r in rows["on"])
    assert any("ndcg@20" in r for r in rows["on"])
    ckpt = tmp_path / "on" / "checkpoints" / "step-00000030.pt"      # epoch 2's CF phase
    saved = torch.load(ckpt, weights_only=True)["optimizer"]
    assert {p: isinstance(sd["param_groups"][0]["lr"], float) for p, sd in saved["phases"].items()} == \
        {"cf": True, "kg": True}
    cli("train", *KGAT, "compile.step_graph=off", "--run-dir", str(tmp_path / "resumed"), "--resume", str(ckpt))
    assert_bitwise_equal(weights(tmp_path / "resumed"), weights(tmp_path / "off"))

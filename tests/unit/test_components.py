"""A run's components (trainer/engine/callbacks.py): a concern added from tests/ with one registration line and no
edit to the loops is called at every hook and can stop the steps; the built-in components, each alone."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, clean_env
from tests.inprocess import cli
from trainer.config.settings import CheckpointConfig
from trainer.distributed.runtime import DistInfo
from trainer.distributed.stragglers import Straggler, StragglerWatch
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.engine.components.eviction import Eviction
from trainer.engine.components.limits import StepLimit
from trainer.engine.components.logging_window import WindowFigures
from trainer.engine.components.periodic import PeriodicSaves
from trainer.engine.components.progress import ProgressBar
from trainer.engine.components.stragglers import Stragglers
from trainer.engine.state import TrainState
from trainer.launch.exitcodes import UNFIT_HOST, StragglerError

# 256 samples / batch 32 = 8 steps an epoch
TOY = ("train", "--recipe", "toy", "--batch-size", "32", "log.tensorboard=false", "log.every_steps=3")
PLUGGED = dict(TRAINER_PLUGINS="tests.toy_recipe,tests.step_log_component")


def hooks(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "step_log.jsonl").read_text().splitlines()]


def test_a_component_from_tests_is_called_at_every_hook_with_one_registration_line(tmp_path):
    plugin = (REPO / "tests/step_log_component.py").read_text()
    assert plugin.count("register_component(") == 1 and plugin.rstrip().endswith("register_component(StepLog)")
    run_dir = tmp_path / "run"
    cli(*TOY, "--epochs", "2", "--run-dir", str(run_dir), "ckpt.every_steps=5", env=clean_env(**PLUGGED))
    calls = hooks(run_dir)
    names = [c["hook"] for c in calls]
    assert names.count("epoch_start") == 2 and names.count("epoch_end") == 2 and names.count("evaluated") == 2
    steps = [c for c in calls if c["hook"] == "step_end"]
    assert [c["step"] for c in steps] == list(range(1, 17))
    assert [c["micro"] for c in steps] == list(range(1, 9)) * 2
    assert [c["step"] for c in steps if c["epoch_done"]] == [8, 16]
    assert [c["stop"] for c in calls if c["hook"] == "epoch_end"] == ["epoch done", "epoch done"]
    # every checkpoint written: periodic at 5 and 10, best after each epoch, periodic after epoch 0 (not the last)
    # at step 15, the final one
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt"))
    assert names.count("saved") == 7 and "step-00000015.pt" in checkpoints
    assert names[-1] == "close" and names.count("close") == 1
    assert [c["last"] for c in calls if c["hook"] == "evaluated"] == [False, True]


def test_a_component_from_tests_stops_the_steps(tmp_path):
    run_dir = tmp_path / "run"
    cli(*TOY, "--epochs", "3", "--run-dir", str(run_dir), env=clean_env(STEP_LOG_STOP_AT="11", **PLUGGED))
    calls = hooks(run_dir)
    assert [c["step"] for c in calls if c["hook"] == "step_end"][-1] == 11
    assert [c["stop"] for c in calls if c["hook"] == "epoch_end"] == ["epoch done", "step log: STEP_LOG_STOP_AT"]
    import torch
    final = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    assert final["global_step"] == 11


def test_a_stop_ends_that_steps_calls_and_the_components_run_in_order():
    order = []

    class Says(Component):
        def __init__(self, name, stop=None):
            self.name, self.stop = name, stop

        def step_end(self, step):
            order.append(self.name)
            return self.stop
    mine = Stop("b: its own reason", code=71)                # open: a component makes its own stop
    chain = (Says("a"), Says("b", mine), Says("c"))
    step = StepEnd(0, 1, 8, 1, 0.1)
    stop = next((s for c in chain if (s := c.step_end(step)) is not None), None)
    assert stop is mine and stop.ends_run and order == ["a", "b"]
    assert not Stop("train.max_steps reached").ends_run                 # code 0: the run's normal end
    assert "next((s for c in self.components if (s := c.step_end(step)) is not None)" in \
        (REPO / "trainer/engine/loop.py").read_text()          # the loop's own chain is this one


def test_the_epoch_loop_keeps_only_what_stepping_needs():
    import ast
    tree = ast.parse((REPO / "trainer/engine/loop.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EpochLoop")
    attributes = {t.attr for n in ast.walk(loop) if isinstance(n, (ast.Assign, ast.AugAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert attributes == {"run", "state", "meter", "losses", "components", "end", "first", "waited"}


def test_periodic_saves_every_steps_inside_an_epoch_and_after_its_evaluation():
    saved = []
    state = TrainState()
    periodic = PeriodicSaves(CheckpointConfig(every_steps=4, every_epochs=0), state, saved.append)
    for step in range(1, 9):
        state.global_step = step
        periodic.step_end(StepEnd(0, step, 8, step, 0.1))
    assert saved == ["periodic"]                       # step 4; step 8 ends the epoch: after its evaluation
    state.epoch = 1
    periodic.evaluated(0, last=False)
    periodic.evaluated(0, last=True)                   # the final checkpoint follows the last epoch
    assert saved == ["periodic", "periodic"]
    by_epoch = PeriodicSaves(CheckpointConfig(every_steps=0, every_epochs=2), state, saved.append)
    by_epoch.evaluated(0, last=False)                  # epoch 1 done: not due
    state.epoch = 2
    by_epoch.evaluated(1, last=False)
    assert len(saved) == 3


def test_the_step_limit_counts_the_schedules_steps():
    scheduler = SimpleNamespace(last_epoch=4)
    assert StepLimit(5, scheduler).step_end(StepEnd(0, 4, 8, 4, 0.1)) is None
    scheduler.last_epoch = 5
    assert StepLimit(5, scheduler).step_end(StepEnd(0, 5, 8, 5, 0.1)) == Stop("train.max_steps reached")
    assert StepLimit(0, scheduler).step_end(StepEnd(0, 5, 8, 5, 0.1)) is None


@pytest.mark.parametrize("action,hosts,evicted", [("evict", ["a", "b"], True), ("warn", ["a", "b"], False),
                                                  ("evict", ["a", "a"], False)])
def test_eviction_acts_on_a_named_straggler_that_can_be_left_out(action, hosts, evicted):
    stragglers = Stragglers(DistInfo(), action)
    eviction = Eviction(stragglers)
    assert eviction.step_end(StepEnd(0, 1, 8, 1, 0.1)) is None
    stragglers.named = Straggler(1, hosts[1], 3.0, 3, evictable=len(set(hosts)) > 1)
    stop = eviction.step_end(StepEnd(0, 2, 8, 2, 0.1))
    assert (stop is not None) is evicted and (eviction.evicted is not None) is evicted and stragglers.named is None
    if evicted:                  # checkpointed by the fit loop, then exit 5 naming the host
        assert stop.code == UNFIT_HOST and stop.reason == f"straggler {hosts[1]} evicted"
        with pytest.raises(StragglerError, match=hosts[1]):
            stop.then()


def test_the_straggler_watch_judges_windows_of_a_second_and_names_after_three():
    stragglers = Stragglers(DistInfo(), "warn")
    stragglers.watch = StragglerWatch(["a", "b"])        # two ranks' hosts (a single process gathers its own)
    assert stragglers.window_read(WindowFigures([0.1, 0.3], wall_s=0.3, steps=2)) is False     # 0.6 s: not yet
    assert stragglers.take_fields() == {}
    for _ in range(3):
        assert stragglers.window_read(WindowFigures([0.1, 0.3], wall_s=0.3, steps=4)) is True
    assert stragglers.take_fields()["straggler_rank"] == 1 and stragglers.take_named().rank == 1


def test_the_progress_bar_follows_the_micro_batches_and_shows_the_logged_loss(capsys):
    window = SimpleNamespace(logged_at=-1, record={})
    bar = ProgressBar(DistInfo(), "on", window)
    bar.epoch_start(0, 2, 8)
    bar.step_end(StepEnd(0, 4, 8, 2, 0.1))
    assert bar.bar.n == 4
    window.logged_at, window.record = 3, dict(loss=0.5, lr=1e-3)
    bar.step_end(StepEnd(0, 6, 8, 3, 0.1))
    assert bar.bar.n == 6 and "loss=0.5000" in str(bar.bar)
    bar.epoch_end(0, None)
    assert bar.bar is None
    assert ProgressBar(DistInfo(rank=1, world_size=2), "on", window).shown is False

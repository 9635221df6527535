"""Stalls injected into a real recipe's default path from outside the engine (tests/distributed/test_hang_defaults.py),
loaded with TRAINER_PLUGINS=tests.stall_plugin: at optimizer step STALL_AT_STEP (1-based), rank STALL_RANK (-1: every
rank) stalls inside the recipe's before_step, in the middle of a step, the way STALL_HOW says:

    stop        SIGSTOP itself (alive and silent, its watch thread stopped too)
    python      a loop in Python that never returns (its watch alive: a stalled loader, a read that never returns)
    native_gil  a C call that holds the interpreter (ctypes.PyDLL's sleep): its watch cannot run
    native      a C call that lets go of it (a blocked read of a pipe nobody writes)
    hook        no stall in the step: the recipe's on_epoch_end of epoch 0 takes STALL_S seconds (a long phase)
    slow        no stall: from that step on, each of its steps takes STALL_S (default 3) times longer, a sleep inside
                the step of STALL_S x the median of its steps before (a straggler, at the recipe's own step time)
    build       no stall in the steps: its build of the data cache (trainer/data/cache.py, the parse) first sleeps
                STALL_S seconds (a large first build)
    SIGUSR1...  no stall: the rank sends itself that signal (a preemption that reached one rank only)

The engine is not edited for it: a component factory wraps the recipe instance's methods."""
from __future__ import annotations

import ctypes
import os
import signal
import statistics
import time

from trainer.engine.callbacks import Component, register_component


def _stall(how: str) -> None:
    if how.startswith("SIG"):
        os.kill(os.getpid(), signal.Signals[how])
        return
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "python":
        while True:
            sum(range(10_000))
    elif how == "native_gil":
        ctypes.PyDLL(None).sleep(100_000)
    elif how == "native":
        read_end, _ = os.pipe()
        os.read(read_end, 1)
    raise AssertionError(f"STALL_HOW={how!r}")


class Stall(Component):
    """Counts optimizer steps; the wrapped before_step stalls at the chosen one."""

    def __init__(self, trainer):
        self.how, self.at = os.environ["STALL_HOW"], int(os.environ.get("STALL_AT_STEP", "3"))
        wanted = int(os.environ.get("STALL_RANK", "1"))
        self.mine, self.steps = wanted in (-1, trainer.info.rank), 0
        self.factor = max(float(os.environ.get("STALL_S") or 3) - 1, 0)     # the sleep adds this many steps' time
        self.took: list[float] = []          # its step times before the slowdown
        self.last = time.perf_counter()
        recipe = trainer.run.recipe
        before, epoch_end = recipe.before_step, recipe.on_epoch_end

        def before_step(batch):
            if self.mine and self.how == "slow" and self.steps + 1 >= self.at and self.took:
                time.sleep(self.factor * statistics.median(self.took))
            elif self.mine and self.how not in ("hook", "slow") and self.steps + 1 == self.at:
                _stall(self.how)
            return before(batch)

        def on_epoch_end(epoch, model):
            if self.mine and self.how == "hook" and epoch == 0:
                time.sleep(float(os.environ["STALL_S"]))
            return epoch_end(epoch, model)

        recipe.before_step, recipe.on_epoch_end = before_step, on_epoch_end

    def step_end(self, step):
        self.steps += 1
        now = time.perf_counter()
        if self.steps > 1 and self.steps < self.at:         # the first step's imports and warm-up left out
            self.took.append(now - self.last)
        self.last = now
        return None


def _slow_cache_builds() -> None:
    """STALL_HOW=build: this process's data-cache builds sleep first (before the trainer exists: at import)."""
    from trainer.data import cache
    build = cache._build_into

    def slow_build(*args, **kwargs):
        if int(os.environ.get("STALL_RANK", "1")) in (-1, int(os.environ.get("RANK", "0"))):
            time.sleep(float(os.environ["STALL_S"]))
        return build(*args, **kwargs)
    cache._build_into = slow_build


if os.environ.get("STALL_HOW") == "build":
    _slow_cache_builds()
register_component(lambda trainer: Stall(trainer) if os.environ.get("STALL_HOW") not in (None, "", "build") else None)

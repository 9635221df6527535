"""Stalls injected into a real recipe's default path from outside the engine (tests/distributed/test_hang_defaults.py),
loaded with TRAINER_PLUGINS=tests.stall_plugin: at optimizer step STALL_AT_STEP (1-based), rank STALL_RANK (-1: every
rank) stalls inside the recipe's before_step, in the middle of a step, the way STALL_HOW says:

    stop        SIGSTOP itself (alive and silent, its watch thread stopped too)
    python      a loop in Python that never returns (its watch alive: a stalled loader, a read that never returns)
    native_gil  a C call that holds the interpreter (ctypes.PyDLL's sleep): its watch cannot run
    native      a C call that lets go of it (a blocked read of a pipe nobody writes)
    hook        no stall in the step: the recipe's on_epoch_end of epoch 0 takes STALL_S seconds (a long phase)
    SIGUSR1...  no stall: the rank sends itself that signal (a preemption that reached one rank only)

The engine is not edited for it: a component factory wraps the recipe instance's methods."""
from __future__ import annotations

import ctypes
import os
import signal
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
        recipe = trainer.run.recipe
        before, epoch_end = recipe.before_step, recipe.on_epoch_end

        def before_step(batch):
            if self.mine and self.how != "hook" and self.steps + 1 == self.at:
                _stall(self.how)
            return before(batch)

        def on_epoch_end(epoch, model):
            if self.mine and self.how == "hook" and epoch == 0:
                time.sleep(float(os.environ["STALL_S"]))
            return epoch_end(epoch, model)

        recipe.before_step, recipe.on_epoch_end = before_step, on_epoch_end

    def step_end(self, step):
        self.steps += 1
        return None


register_component(lambda trainer: Stall(trainer) if os.environ.get("STALL_HOW") else None)

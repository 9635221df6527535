"""torchrun's shutdown budget: an agent SIGKILLs its workers a fixed time after forwarding a signal (its
--shutdown-timeout, DistInfo.agent_shutdown_s); a step plus a checkpoint must fit in it, or a signal costs the
checkpoint. A component of the run (trainer/engine/callbacks.py): it times the steps and hears of each save."""
from __future__ import annotations

import logging

from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.preemption import FORWARD_HINT

log = logging.getLogger(__name__)


class ShutdownBudget(Component):
    """An agent (torchrun) SIGKILLs its workers agent_shutdown_s after forwarding a signal: the slowest
    step plus a checkpoint must fit in that, or a signal costs the checkpoint. Warns once, on rank 0,
    after the first checkpoint that shows it does not fit."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> ShutdownBudget:
        return cls(ctx.info)

    def __init__(self, info: DistInfo):
        self.limit, self.is_main = info.agent_shutdown_s, info.is_main
        self.steps, self.slowest_step = 0, 0.0
        self.warned = False

    def step_end(self, step: StepEnd) -> Stop | None:
        self.step(step.seconds)
        return None

    def step(self, seconds: float) -> None:
        """One optimizer step's wall time (the run's first, with its warm-up, does not count)."""
        self.steps += 1
        if self.steps > 1:
            self.slowest_step = max(self.slowest_step, seconds)

    def saved(self, seconds: float) -> None:
        """A checkpoint took `seconds`."""
        need = self.slowest_step + seconds
        if self.limit is None or self.warned or not self.is_main or need <= self.limit:
            return
        self.warned = True
        log.warning("a step plus a checkpoint take %.1f s here, but torchrun kills its workers %.0f s after "
                    "forwarding a signal: a preemption would then lose the work since the last checkpoint.\n"
                    "HINT: %s", need, self.limit, FORWARD_HINT.replace("120", str(int(2 * need) + 10)))

"""faults.straggler_action=evict: a straggler named in a logging window (stragglers.py), while a world is left
without its host, stops the steps; the fit loop checkpoints, then the stop raises StragglerError: exit 5, which the
restart loop (slurm/common.sh) reads as "relaunch without this host"."""
from __future__ import annotations

import logging

from trainer.distributed.stragglers import Straggler
from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.components.stragglers import Stragglers
from trainer.engine.exits import exit_of
from trainer.launch.exitcodes import StragglerError

log = logging.getLogger(__name__)


class Eviction(Component):
    """A stop once a straggler can be left out (every rank named the same one from the same window's collective:
    no vote needed); `evicted` names it."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> Eviction | None:
        """Acts on the run's straggler watch, where there is one."""
        stragglers = ctx.component(Stragglers)
        return cls(stragglers) if stragglers is not None else None

    def __init__(self, stragglers: Stragglers):
        self.stragglers = stragglers
        self.evicted: Straggler | None = None

    def step_end(self, step: StepEnd) -> Stop | None:
        named = self.stragglers.take_named()
        if named is not None and named.evictable and self.stragglers.action == "evict":
            self.evicted = named
        if self.evicted is None:
            return None
        straggler = self.evicted

        error = StragglerError(straggler.host, straggler.describe())

        def then() -> None:
            log.warning("straggler evicted: checkpoint of step %d written; exit 5 (unfit host %s)", step.step,
                        straggler.host)
            raise error
        return Stop(f"straggler {straggler.host} evicted", code=exit_of(error).code, then=then)

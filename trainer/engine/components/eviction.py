"""train.straggler_action=evict: a straggler named in a logging window (stragglers.py), while a world is left
without its host, stops the steps (Stop.EVICT); the fit loop then checkpoints and exits 5, which the restart loop
(slurm/common.sh) reads as "relaunch without this host"."""
from __future__ import annotations

from trainer.distributed.stragglers import Straggler
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.engine.components.stragglers import Stragglers


class Eviction(Component):
    """Stop.EVICT once a straggler can be left out; `evicted` names it."""

    def __init__(self, stragglers: Stragglers):
        self.stragglers = stragglers
        self.evicted: Straggler | None = None

    def step_end(self, step: StepEnd) -> Stop | None:
        named = self.stragglers.take_named()
        if named is not None and named.evictable and self.stragglers.action == "evict":
            self.evicted = named
        return Stop.EVICT if self.evicted is not None else None

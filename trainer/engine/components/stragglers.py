"""The straggler watch while training (faults.straggler_action warn|evict): each logging window's collective carries
every rank's own time per step (trainer/engine/components/logging_window.py); a rank at FACTOR or more of the
others' median for WINDOWS judged windows in a row is named (trainer/distributed/stragglers.py StragglerWatch), with
a warning and the window's fields in its train record. Eviction (eviction.py) acts on the name.

    stragglers = Stragglers(info, "warn")              # one gather of the ranks' hosts
    stragglers.window_read(figures)                    # LoggingWindow calls it with every window's figures: judged?
"""
from __future__ import annotations

import logging
from typing import Any

from trainer.distributed import preflight, runtime
from trainer.distributed.runtime import DistInfo
from trainer.distributed.stragglers import JUDGED_S, Straggler, StragglerWatch, watched
from trainer.engine.callbacks import Component, RunContext
from trainer.engine.components.logging_window import WindowFigures

log = logging.getLogger(__name__)


class Stragglers(Component):
    """Names a straggler from the logging windows' figures; `named` until Eviction takes it."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> Stragglers | None:
        action = ctx.cfg.faults.straggler_action
        return cls(ctx.info, action) if cls.wanted(ctx.info, action) else None

    def __init__(self, info: DistInfo, action: str):
        self.info, self.action = info, action
        self.watch = StragglerWatch(runtime.all_gather_object(preflight.host_name(), info))   # each rank's host
        self.fields: dict[str, Any] = {}      # the straggler fields of the window being logged
        self.named: Straggler | None = None

    @staticmethod
    def wanted(info: DistInfo, action: str) -> bool:
        """A single process, and faults.straggler_action=off, watch nothing."""
        return watched(info, action)

    def window_read(self, figures: WindowFigures) -> bool:
        """A window whose figures span at least JUDGED_S of rank 0's wall time is judged (shorter ones add up: False,
        the window's clock keeps them)."""
        if figures.wall_s * figures.steps < JUDGED_S:
            return False
        self.fields, self.named = self.watch.observe(figures.own)
        if self.named is not None and self.info.is_main:
            log.warning("straggler: %s; %s", self.named.describe(), self._action_text(self.named))
        return True

    def _action_text(self, named: Straggler) -> str:
        if self.action != "evict":
            return "faults.straggler_action=evict would relaunch without it"
        if not named.evictable:
            return f"not evicted: every rank runs on {named.host}"
        return f"checkpointing, then exit 5 so that the run goes on without {named.host}"

    def take_fields(self) -> dict[str, Any]:
        """The straggler fields for the window's train record (then cleared)."""
        fields, self.fields = self.fields, {}
        return fields

    def take_named(self) -> Straggler | None:
        """The straggler named since the last call, if any."""
        named, self.named = self.named, None
        return named

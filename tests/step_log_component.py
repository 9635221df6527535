"""A component added from outside the engine (tests/unit/test_components.py): it logs every hook the loops call into
RUN_DIR/step_log.jsonl and, when STEP_LOG_STOP_AT is set, stops the run's steps at that optimizer step. Loaded with
TRAINER_PLUGINS=tests.toy_recipe,tests.step_log_component; the engine is not edited for it."""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.engine.callbacks import Component, StepEnd, Stop, register_component


class StepLog(Component):
    """Every hook call as one JSON line (rank 0 only)."""

    def __init__(self, trainer):
        self.path = Path(trainer.cfg.run_dir) / "step_log.jsonl"
        self.stop_at = int(os.environ.get("STEP_LOG_STOP_AT", "0"))
        self.is_main = trainer.info.is_main

    def _log(self, hook: str, **fields) -> None:
        if self.is_main:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(dict(hook=hook, **fields)) + "\n")

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        self._log("epoch_start", epoch=epoch, first=first, end=end)

    def step_end(self, step: StepEnd) -> Stop | None:
        self._log("step_end", epoch=step.epoch, micro=step.micro, step=step.step, epoch_done=step.epoch_done)
        return Stop("step log: STEP_LOG_STOP_AT") if step.step == self.stop_at else None

    def epoch_end(self, epoch: int, stop: Stop | None) -> None:
        self._log("epoch_end", epoch=epoch, stop=stop.reason if stop else "epoch done")

    def evaluated(self, epoch: int, last: bool) -> None:
        self._log("evaluated", epoch=epoch, last=last)

    def saved(self, seconds: float) -> None:
        self._log("saved")

    def close(self) -> None:
        self._log("close")


register_component(StepLog)

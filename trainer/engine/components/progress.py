"""Rank 0's progress: a bar over an epoch's micro-batches (log.progress: auto shows it on a terminal), with the last
logging window's loss and learning rate; one line when the first step is done, with the time it took to get there."""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.components.logging_window import LoggingWindow
from trainer.native.console import progress_bar

log = logging.getLogger(__name__)


class ProgressBar(Component):
    """A tqdm bar per epoch; none off rank 0, with log.progress=off, or (auto) off a terminal."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> ProgressBar:
        """Rank 0's bar, showing the run's logging window's last record."""
        return cls(ctx.info, ctx.cfg.log.progress, ctx.component(LoggingWindow))

    def __init__(self, info: DistInfo, mode: str, window: LoggingWindow):
        self.shown = info.is_main and mode != "off" and (mode == "on" or sys.stderr.isatty())
        self.window, self.bar = window, None

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        if self.shown:
            self.bar = progress_bar(total=end, initial=first, desc=f"epoch {epoch}", unit="batch",
                                    dynamic_ncols=True, leave=False)

    def step_end(self, step: StepEnd) -> Stop | None:
        if self.bar is not None:
            self.bar.update(step.micro - self.bar.n)
            if self.window.logged_at == step.step:
                record = self.window.record
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
        return None

    def epoch_end(self, epoch: int, stop: Stop | None) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def process_seconds() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere since the trainer was imported)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class FirstStep(Component):
    """Rank 0's one line when the run's first optimizer step is done, with the seconds since the process started:
    what a user waits through before training (imports, data, model, pre-flight; a C++ build, were one waited for)
    shows as one figure."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> FirstStep:
        return cls(ctx.info)

    def __init__(self, info: DistInfo):
        self.pending = info.is_main

    def step_end(self, step: StepEnd) -> Stop | None:
        if self.pending:
            self.pending = False
            log.info("first step done %.1f s after the process started (imports, data, model, pre-flight)",
                     process_seconds())
        return None

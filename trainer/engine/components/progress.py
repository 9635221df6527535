"""Rank 0's progress bar over an epoch's micro-batches (train.progress: auto shows it on a terminal), with the last
logging window's loss and learning rate."""
from __future__ import annotations

import sys

from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.engine.components.logging_window import LoggingWindow
from trainer.native.console import progress_bar


class ProgressBar(Component):
    """A tqdm bar per epoch; none off rank 0, with train.progress=off, or (auto) off a terminal."""

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

    def epoch_end(self, epoch: int, stop: Stop) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

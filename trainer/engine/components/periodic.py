"""Periodic checkpoints: every ckpt.every_steps optimizer steps (inside an epoch; at an epoch's end after its
evaluation) and every ckpt.every_epochs epochs, never at the run's last epoch (the final checkpoint follows it)."""
from __future__ import annotations

from typing import Callable

from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.state import TrainState


class PeriodicSaves(Component):
    """ckpt.every_steps and ckpt.every_epochs; save(kind) is the run owner's (the losses read first)."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> PeriodicSaves:
        return cls(ctx.cfg.ckpt, ctx.state, ctx.save)

    def __init__(self, ckpt_cfg, state: TrainState, save: Callable[[str], None]):
        self.every_steps, self.every_epochs = ckpt_cfg.every_steps, ckpt_cfg.every_epochs
        self.state, self.save = state, save

    def step_end(self, step: StepEnd) -> Stop | None:
        if self.every_steps > 0 and step.step % self.every_steps == 0 and not step.epoch_done:
            self.save("periodic")       # at the epoch's end: after its evaluation (evaluated)
        return None

    def evaluated(self, epoch: int, last: bool) -> None:
        state = self.state
        due = (self.every_epochs > 0 and state.epoch % self.every_epochs == 0) or \
            (self.every_steps > 0 and state.global_step % self.every_steps == 0)
        if due and not last:
            self.save("periodic")

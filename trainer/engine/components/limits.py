"""train.max_steps: the steps stop once the schedule has taken that many (a resume in another layout converted the
count: trainer/engine/resume.py continue_at)."""
from __future__ import annotations

from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop

MAX_STEPS = Stop("train.max_steps reached")       # code 0: the run's normal end (final checkpoint, test)


class StepLimit(Component):
    """MAX_STEPS at train.max_steps steps of the schedule (0: no limit)."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> StepLimit:
        return cls(ctx.cfg.train.max_steps, ctx.run.scheduler)

    def __init__(self, max_steps: int, scheduler):
        self.max_steps, self.scheduler = max_steps, scheduler

    def step_end(self, step: StepEnd) -> Stop | None:
        if 0 < self.max_steps <= self.scheduler.last_epoch:
            return MAX_STEPS              # (the final checkpoint's save reads the losses first)
        return None

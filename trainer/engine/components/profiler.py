"""log.profile=START:STOP: a torch.profiler trace of optimizer steps START..STOP on every rank (the seed HAR
guide's "profile single GPU first"), for TensorBoard's profiler plugin or Perfetto, and a top-10 table.

    python -m trainer train --recipe har log.profile=10:15       # RUN_DIR/profile/rank0.pt.trace.json

CPU activity always, CUDA activity on a GPU; shapes and memory recorded. Steps are the run's optimizer steps
(counted from 1, as in metrics.jsonl), so a resumed run profiles the same steps if it has not passed them.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.state import TrainState

log = logging.getLogger(__name__)


def parse_steps(spec: str) -> tuple[int, int]:
    """(START, STOP) from 'START:STOP', or a ValueError naming log.profile and an example."""
    try:
        start, stop = (int(part) for part in spec.split(":"))
    except ValueError:
        start = stop = 0
    if not 1 <= start <= stop:
        raise ValueError(f"log.profile={spec!r}: expected START:STOP, the first and last optimizer step to "
                         f"profile (1 <= START <= STOP), e.g. log.profile=10:15")
    return start, stop


class StepProfiler(Component):
    """Starts torch.profiler before optimizer step START and stops it after STOP; writes the trace of this
    rank into RUN_DIR/profile and logs the top ops by device time (rank 0)."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> StepProfiler:
        return cls(ctx.cfg.log.profile, ctx.run_dir, ctx.info, ctx.state)

    def __init__(self, spec: str, run_dir: str | Path, info: DistInfo, state: TrainState | None = None):
        """spec '' (log.profile unset): profiles nothing. state: the run's, whose steps are counted."""
        self.start, self.stop = parse_steps(spec) if spec else (0, 0)
        self.dir, self.info, self.state = Path(run_dir) / "profile", info, state or TrainState()
        self.cuda = info.device.startswith("cuda")
        self.prof: profile | None = None
        self.done = not spec

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        self.at(self.state.global_step)

    def step_end(self, step: StepEnd) -> Stop | None:
        self.at(step.step)
        return None

    def at(self, step: int) -> None:
        """Call with the number of optimizer steps done so far, before the next one and after each one."""
        if self.done:
            return
        if self.prof is None and step == self.start - 1:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.prof.__enter__()
            log.info("profiling optimizer steps %d-%d (log.profile)", self.start, self.stop)
        elif self.prof is not None and step >= self.stop:
            self.close()

    def close(self) -> None:
        """Stop (a run that ends inside the range keeps what it has) and write the trace."""
        if self.prof is None or self.done:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.done = True
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.info.rank}.pt.trace.json"
        self.prof.export_chrome_trace(str(trace))
        if self.info.is_main:
            key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=key, row_limit=10)
            log.info("profile of optimizer steps %d-%d: %s (open in ui.perfetto.dev, or tensorboard --logdir %s "
                     "with torch-tb-profiler); top ops by %s time:\n%s", self.start, self.stop, trace, self.dir,
                     "device" if self.cuda else "CPU", table)

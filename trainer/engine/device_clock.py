"""A rank's own time per step as its device saw it, for the straggler watch on a GPU: an event on the compute stream
where the step's first micro-batch begins, and one where its last gradient is ready (a hook on each parameter's
gradient accumulation, recorded on the stream the backward runs on), their time summed over the logging window.

    clock = DeviceClock(model.parameters())           # CUDA events; DeviceClock(params, HostEvent): the host's clock
    clock.step_start()                                 # before the step's first micro-batch
    ...backward...                                     # the hooks record where the last gradient is ready
    clock.step_end()
    seconds, steps = clock.take()                      # after the window's one sync: complete events only

In a run it is a component (the epoch loop tells it step_start and step_end; the logging window takes its figures).

Why: NCCL's all-reduce runs on a stream of its own and its futures complete on the host when the work is queued,
so the host sees no wait, and a window's CUDA time includes the compute stream waiting (at the end of DDP's
backward) for the slowest rank's gradients: every rank measured alike and no straggler was named. Between the
step's first kernel and its last gradient the compute stream waits for no other rank (DDP's all-reduces run beside
it; it waits for them only after the last gradient), whether or not a comm hook is registered. The optimizer step
and the data loader's waits are not in it: the ranks' optimizer steps are alike, and a loader's wait is in the
window's data_wait_frac.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from trainer.distributed.stragglers import watched as stragglers_watched
from trainer.engine.callbacks import Component, RunContext, StepEnd

log = logging.getLogger(__name__)


class HostEvent:
    """torch.cuda.Event's timing interface on the host clock (the CPU path, and tests of the logic)."""

    def __init__(self):
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.at - self.at) * 1000.0


def cuda_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class DeviceClock(Component):
    """Per optimizer step: an event where its first micro-batch begins and one where its last gradient is ready."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> DeviceClock | None:
        """On a GPU where the straggler watch runs: its own time per step (the host only queues the steps)."""
        watched = stragglers_watched(ctx.info, ctx.cfg.faults.straggler_action)
        return cls(ctx.run.model.parameters()) if watched and ctx.run.device.type == "cuda" else None

    def __init__(self, params: Iterable[torch.nn.Parameter], new_event: Callable[[], object] = cuda_event):
        self.new_event = new_event
        self.start = None                       # this step's first event, None between steps
        self.ready = None                       # the event re-recorded at each gradient ready this step
        self.done: list[tuple[object, object]] = []  # the window's steps not yet read
        self.last_param: int | None = None      # learnt: the parameter whose gradient is ready last
        self.order: list[int] = []              # this step's order of ready gradients (while learning)
        self.broken = False
        self.handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                        for p in params if p.requires_grad]

    def step_start(self, epoch: int = 0, micro: int = 0) -> None:
        """Before the step's first micro-batch: the step's start."""
        if self.start is None and not self.broken:
            self.start = self._record()

    def _record(self):
        try:
            event = self.new_event()
            event.record()
            return event
        except RuntimeError as err:             # (an event recorded where the stream cannot take one)
            self.broken = True
            log.warning("the device clock is off (%s): stragglers are judged by the window's time",
                        str(err).splitlines()[0][:200])
            return None

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        """A gradient accumulated: recorded only for the parameter learnt to be ready last (one event a step, not
        one per parameter), every parameter's order noted until it is learnt."""
        if self.start is None:
            return
        key = id(param)
        if self.last_param is None:
            self.order.append(key)
        elif key == self.last_param:
            self.ready = self._record()

    def step_end(self, step: StepEnd | None = None) -> None:
        """After the optimizer step: the step's (start, last gradient ready), when both were recorded."""
        if self.start is None:
            return None
        if self.last_param is None:
            # the first step learns which gradient is ready last; it is timed from the next step on
            self.last_param = self.order[-1] if self.order else None
        elif self.ready is None:
            self.last_param = None              # that parameter had no gradient this step: learn again
        else:
            self.done.append((self.start, self.ready))
        self.start, self.ready, self.order = None, None, []

    def take(self) -> tuple[float, int]:
        """(seconds, steps) of the window's steps whose events are complete (after the window's sync: all of them);
        the others stay for the next window."""
        seconds, steps, pending = 0.0, 0, []
        for start, ready in self.done:
            if ready.query():
                seconds += start.elapsed_time(ready) / 1000.0
                steps += 1
            else:
                pending.append((start, ready))
        self.done = pending
        return seconds, steps

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

"""The training losses since the last read, kept where they were computed: a step stores its loss on the
device and the host reads them once per logging window, before every checkpoint and at the end of an epoch.

    window = LossWindow(device, info, capacity=10)
    window.add(loss, samples, step=7, epoch=0, batch=7)     # no host sync: one copy on the device
    total = window.read()                                   # one collective and one read
    losses = TrainLosses(device, info, capacity=10, state=state)   # the run's: sums per logging window and epoch
    losses.add(loss, samples, epoch=0, batch=7)             # read when full; losses.read(): NonFiniteLossError

A float(loss) per step made the host wait for the GPU at every step (it could not queue the next step's
kernels while the current one ran). Reading before every checkpoint is the rule that keeps a NaN out of the
checkpoints: no checkpoint is written before the read that covers its step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine.state import TrainState

log = logging.getLogger(__name__)


class NonFiniteLossError(ArithmeticError):
    """The training loss became NaN or infinite; the message names the step and the last good checkpoint."""


@dataclass(frozen=True)
class Place:
    """Where a buffered loss was computed: the optimizer step it belongs to, the epoch, the micro-batch count
    of the epoch after it, and its samples."""

    step: int
    epoch: int
    batch: int
    samples: int


@dataclass(frozen=True)
class Reading:
    """A read window, summed over the ranks: the loss sum (each loss times its samples), the samples, and
    the first place where any rank's loss was not finite (None: all finite)."""

    loss_sum: float = 0.0
    samples: float = 0.0
    bad: Place | None = None
    extra: list[float] | None = None     # read(extra=...) summed over the ranks (the same collective)


class LossWindow:
    """Per-micro-batch training losses on the device, until read (capacity: the most kept before a read is
    forced; `full` says when)."""

    def __init__(self, device: torch.device, info: DistInfo, capacity: int):
        self.info, self.places = info, []
        self.buf = torch.zeros(max(capacity, 1), dtype=torch.float32, device=device)

    @property
    def full(self) -> bool:
        return len(self.places) >= len(self.buf)

    def __len__(self) -> int:
        return len(self.places)

    def add(self, loss: torch.Tensor, samples: int, step: int, epoch: int, batch: int) -> None:
        """Keep a micro-batch's mean loss (a device copy: nothing is read)."""
        self.buf[len(self.places)].copy_(loss.detach())
        self.places.append(Place(step, epoch, batch, samples))

    def read(self, extra: torch.Tensor | None = None) -> Reading:
        """The window summed over the ranks (every rank calls it at the same point), then emptied. One
        all-reduce carries the sum, the samples, a flag per buffered loss (so every rank names the same first
        non-finite one) and `extra` (a small host vector, e.g. the preemption flags: one collective, not two)."""
        places, self.places = self.places, []
        tail = [] if extra is None else extra.flatten().tolist()
        if not places and (extra is None or not self.info.distributed):   # (the ranks hold as many losses)
            return Reading(extra=tail if extra is not None else None)
        losses = self.buf[:len(places)].double()
        host = torch.tensor([p.samples for p in places] + tail, dtype=torch.float64).to(losses.device)
        weights = host[:len(places)]
        packed = torch.cat([(losses * weights).sum().reshape(1), weights.sum().reshape(1),
                            (~torch.isfinite(losses)).double(), host[len(places):]])
        packed = runtime.all_reduce(packed.to(runtime.comm_device(self.info)), self.info).tolist()  # the read
        loss_sum, samples, flags = packed[0], packed[1], packed[2:2 + len(places)]
        bad = next((p for p, f in zip(places, flags) if f > 0), None)
        return Reading(loss_sum, samples, bad, packed[2 + len(places):] if extra is not None else None)


def non_finite(reading: Reading, step: int, last_good: str) -> NonFiniteLossError:
    """The error for a read window with a NaN/inf loss on any rank: nothing is written after it, and every
    checkpoint on disk was written before the read, so the last good one stays the newest."""
    bad = reading.bad
    return NonFiniteLossError(
        f"non-finite loss at step {bad.step} (epoch {bad.epoch}, batch {bad.batch}); training stopped at step "
        f"{step}, {last_good}.\nHINT: lower --lr, set optim.clip_grad_norm, use --amp bf16 instead of fp16, "
        f"check the data for NaN/inf; continue with --resume auto.")


class TrainLosses:
    """A run's training losses: each micro-batch's kept on the device (LossWindow), read in one collective (by the
    logging window, before every checkpoint, at an epoch's end, or when the buffer is full), and summed over the
    ranks since the last logging window and since the epoch started. A non-finite loss on any rank stops the run at
    the read (every checkpoint follows such a read: none holds weights a non-finite loss went into).
    last_good: rank 0's newest checkpoint, for that error (None: no checkpoints are kept)."""

    def __init__(self, device: torch.device, info: DistInfo, capacity: int, state: TrainState,
                 last_good: Callable[[], str] | None = None):
        self.info, self.state, self.last_good = info, state, last_good
        self.buffer = LossWindow(device, info, capacity)
        self.window = [0.0, 0.0]          # loss sum and samples read since the last logging window (over the ranks)
        self.epoch = [0.0, 0.0]           # the same since the epoch (or its resumed part) started

    def add(self, loss: torch.Tensor, samples: int, epoch: int, batch: int) -> None:
        """A micro-batch's mean loss and samples, of the optimizer step to come (no host sync)."""
        if self.buffer.full:            # log.every_steps beyond the buffer: read it now
            self.read()
        self.buffer.add(loss, samples, self.state.global_step + 1, epoch, batch)

    def read(self, extra: torch.Tensor | None = None) -> list[float] | None:
        """Read the buffered losses (one sync); `extra` rides in the same collective and comes back summed over the
        ranks (None without it)."""
        reading = self.buffer.read(extra)
        if reading.bad is not None:
            last = "rank 0 names the last good checkpoint" if not self.info.is_main else \
                self.last_good() if self.last_good is not None else "no checkpoint was written yet"
            raise non_finite(reading, self.state.global_step, last)
        for sums in (self.window, self.epoch):
            sums[0] += reading.loss_sum
            sums[1] += reading.samples
        return reading.extra

    def take_window(self) -> tuple[float, float]:
        """The logging window's (loss sum, samples), then a new window."""
        taken, self.window = self.window, [0.0, 0.0]
        return taken[0], taken[1]

    def start_epoch(self) -> None:
        self.epoch = [0.0, 0.0]

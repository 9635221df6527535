"""The training losses since the last read, kept where they were computed: a step stores its loss on the
device and the host reads them once per logging window, before every checkpoint and at the end of an epoch.

    window = LossWindow(device, info, capacity=10)
    window.add(loss, samples, step=7, epoch=0, batch=7)     # no host sync: one copy on the device
    total = window.read()                                   # one collective and one read; NonFiniteLossError

A float(loss) per step made the host wait for the GPU at every step (it could not queue the next step's
kernels while the current one ran). Reading before every checkpoint is the rule that keeps a NaN out of the
checkpoints: no checkpoint is written before the read that covers its step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo


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

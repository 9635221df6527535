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

import logging
from dataclasses import dataclass
from typing import Any

import torch

from trainer.distributed import preflight, runtime
from trainer.distributed.runtime import DistInfo
from trainer.distributed.stragglers import JUDGED_S, StepClock, Straggler, StragglerWatch, own_times, window_slots
from trainer.engine.preemption import AgreementCadence

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


class WindowExchange:
    """What rides with the losses in a logging window's one collective besides them (LossWindow.read's extra): the
    signal flags, each rank's own time per step and rank 0's wall time per step (trainer/distributed/stragglers.py);
    and what every rank makes of the sum, alike: the signal agreement's cadence (ckpt.signal_latency_s) and the
    straggler watch (train.straggler_action)."""

    def __init__(self, info: DistInfo, cfg, cuda: bool = False):
        self.info, self.action, self.cuda = info, cfg.train.straggler_action, cuda
        self.cadence = AgreementCadence(info, cfg.ckpt.signal_latency_s, cfg.train.log_every_steps)
        self.clock = StepClock()
        self.steps = 0                    # the steps whose figures were sent
        self.fields: dict[str, Any] = {}  # the straggler fields of the window being logged
        self.named: Straggler | None = None
        self.evicted: Straggler | None = None
        # each rank's host: one gather at the start (a single process and action off watch nothing)
        self.watch = StragglerWatch(runtime.all_gather_object(preflight.host_name(), info)) \
            if info.distributed and self.action != "off" else None

    def stepped(self, seconds: float) -> float:
        """An optimizer step's wall time on the host (timed whole per window on a GPU: logged())."""
        if not self.cuda:
            self.clock.step(seconds)
        return seconds

    def waited(self, seconds: float) -> float:
        """A step's wait in its collectives (gradsync's timer)."""
        if not self.cuda:
            self.clock.waited(seconds)
        return seconds

    def logged(self, rates: dict[str, float], steps: int, measure_sync: bool) -> dict[str, float]:
        """A window is logged: its figures are fixed for the next window's collective. On a GPU the host only
        queues the steps, so the window's CUDA-event time (Throughput's) is their time. Returns the rates to log
        (sync_wait_frac only where train.measure_sync asked for it)."""
        if self.cuda:
            wall = rates["step_time_s"] * steps
            self.clock.add(wall, wall * rates.get("sync_wait_frac", 0.0), steps)
        self.clock.mark()
        if not measure_sync:
            rates.pop("sync_wait_frac", None)
        return rates

    def sent(self, preempt) -> torch.Tensor | None:
        """This rank's extra for the window's collective: the signal flags, then the clock's marked figures
        (None for a single process: nothing to agree)."""
        if not self.info.distributed:
            return None
        own_s, wall_s, self.steps = self.clock.figures()
        return torch.cat([preempt.flags().double(), window_slots(self.info, own_s, wall_s)])

    def signal(self, preempt, summed: list[float] | None, step: int) -> int:
        """The agreed signal of the window's collective (sent()'s extra summed over the ranks)."""
        self.cadence.agreed(step)
        if summed is None:
            return preempt.received
        return preempt.signal_of(self.received(summed, len(preempt.flags())))

    def received(self, summed: list[float], n_flags: int) -> list[float]:
        """The extra summed over the ranks: the cadence and the watch take their figures; returns the flags."""
        own, wall_s = own_times(summed[n_flags:], self.info.world_size)
        self.cadence.measured(wall_s)
        if self.watch is not None and wall_s * self.steps >= JUDGED_S:
            self.clock.judged()
            self.fields, self.named = self.watch.observe(own)
            if self.named is not None and self.info.is_main:
                log.warning("straggler: %s; %s", self.named.describe(), self._action_text(self.named))
        return summed[:n_flags]

    def _action_text(self, named: Straggler) -> str:
        if self.action != "evict":
            return "train.straggler_action=evict would relaunch without it"
        if not named.evictable:
            return f"not evicted: every rank runs on {named.host}"
        return f"checkpointing, then exit 5 so that the run goes on without {named.host}"

    def take_fields(self) -> dict[str, Any]:
        """The straggler fields for the window's train record (then cleared)."""
        fields, self.fields = self.fields, {}
        return fields

    def evicting(self) -> bool:
        """A straggler was named in this window, train.straggler_action=evict, and a world is left without it (then
        self.evicted)."""
        named, self.named = self.named, None
        if named is not None and named.evictable and self.action == "evict":
            self.evicted = named
        return self.evicted is not None

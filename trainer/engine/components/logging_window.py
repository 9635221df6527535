"""The logging window: every log.every_steps optimizer steps the ranks read their losses in one collective
(trainer/engine/window.py TrainLosses), which also carries the preemption flags and each rank's step clock
(trainer/distributed/stragglers.py window_slots), and rank 0 writes one train record; between windows the ranks
agree on a signal every few steps (trainer/engine/preemption.py AgreementCadence, ckpt.signal_latency_s).

    window = LoggingWindow.from_run(trainer)   # the run's losses, meter, writer, its PreemptionHandler, DeviceClock
    window.step_end(step)     # a Stop once the ranks agreed on a signal (preemption.signal_stop)

What reads each window's figures (the straggler watch) is a WindowReader, a component built before the window: it
is told the window's per-rank own times, says whether it judged them, and adds its fields to the record.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from trainer.distributed.stragglers import StepClock, own_times, window_slots
from trainer.engine.build import Run
from trainer.engine.callbacks import Component, RunContext, StepEnd, Stop
from trainer.engine.device_clock import DeviceClock
from trainer.engine.logging import MetricsWriter
from trainer.engine.meters import SystemStats, Throughput
from trainer.engine.preemption import AgreementCadence, PreemptionHandler, signal_stop
from trainer.engine.state import TrainState
from trainer.engine.window import TrainLosses
from trainer.engine.write_failures import WriteFailures

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowFigures:
    """A window's collective, as every rank reads it alike: each rank's own seconds per step, rank 0's wall seconds
    per step, and how many steps this rank's figures covered."""

    own: list[float]
    wall_s: float
    steps: int


@runtime_checkable
class WindowReader(Protocol):
    """What reads each logging window's figures (the straggler watch): True from window_read when it judged them (the
    window's step clock then drops what they covered; otherwise the next window's figures add to them)."""

    def window_read(self, figures: WindowFigures) -> bool: ...

    def take_fields(self) -> dict[str, Any]: ...


class LoggingWindow(Component):
    """The loss window's read and the signal agreement, and the train records they make."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> LoggingWindow:
        """The window of the run: its readers are the WindowReader components built before it."""
        return cls(ctx.run, ctx.state, ctx.losses, ctx.meter, ctx.writer, ctx.component(PreemptionHandler), StepClock(),
                   readers=[c for c in ctx.components if isinstance(c, WindowReader)], failures=ctx.failures,
                   device_clock=ctx.component(DeviceClock))

    def __init__(self, run: Run, state: TrainState, losses: TrainLosses, meter: Throughput,
                 writer: MetricsWriter, preempt: PreemptionHandler, clock: StepClock,
                 readers: Sequence[WindowReader] = (), failures: WriteFailures | None = None,
                 device_clock: DeviceClock | None = None):
        self.run, self.info, self.log_cfg, self.state = run, run.info, run.cfg.log, state
        self.losses, self.meter, self.writer, self.preempt = losses, meter, writer, preempt
        self.clock, self.readers, self.device_clock = clock, list(readers), device_clock
        self.timed = run.step is not None and run.step.measures_sync     # the step's collectives are timed
        self.failures = failures or WriteFailures()
        self.cadence = AgreementCadence(run.info, run.cfg.ckpt.signal_latency_s, self.log_cfg.every_steps)
        self.stats = SystemStats()
        self.steps = 0                        # the steps whose clock figures this rank sent
        self.record: dict[str, Any] = {}      # the last train record and its step (the progress bar shows it)
        self.logged_at = -1
        self.epoch_t0 = time.perf_counter()

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        self.losses.start_epoch()
        self.epoch_t0 = time.perf_counter()

    def step_end(self, step: StepEnd) -> Stop | None:
        if not self.meter.cuda:           # on a GPU the host only queues a step: its window's CUDA time is used
            self.clock.step(step.seconds)
            self.clock.waited(step.waited)
        if step.step % max(self.log_cfg.every_steps, 1) == 0:
            signum = self._timed(self._read_window, step.step)     # the window's read agrees on the signal too
            self._log(step.epoch, step.step)
        else:       # between windows, every few steps (ckpt.signal_latency_s)
            turn = self.cadence.turn(step.step)
            signum = self._timed(self.preempt.agreed_signal, self.info) if turn else 0
        if not signum:
            return None
        self.losses.read()                # a non-finite loss before the signal stops the run instead
        return signal_stop(signum, self.preempt.received_at, self.info, self.run.cfg.ckpt.requeue_signals,
                           self.run.cfg.run_dir, self.state)

    def epoch_end(self, epoch: int, stop: Stop | None) -> None:
        """A whole epoch: its losses read and its mean loss and time recorded."""
        if stop is not None:
            return
        self.losses.read()
        loss_sum, count = self.losses.epoch
        if count:
            self.writer.write("train", epoch, self.state.global_step,
                              dict(epoch_loss=loss_sum / count,
                                   epoch_time_s=round(time.perf_counter() - self.epoch_t0, 4)))

    def _timed(self, collective: Callable, *args):
        """A per-step collective; with log.measure_sync its time counts as waiting for the other ranks."""
        if not self.timed:
            return collective(*args)
        t0 = time.perf_counter()
        out = collective(*args)
        self.meter.update(0, synced=time.perf_counter() - t0)
        return out

    def _read_window(self, step: int) -> int:
        """The window's one collective: the losses, the signal flags and the clock's figures; the agreed signal."""
        if not self.info.distributed:              # a single process agrees with itself
            self.losses.read()
            self.cadence.agreed(step)
            self.failures.agree(self.info)
            return self.preempt.received
        flags = self.preempt.flags().double()
        failed = torch.tensor([self.failures.flag()], dtype=torch.float64)   # a failed write on some rank
        own_s, wall_s, self.steps = self.clock.figures()
        summed = self.losses.read(torch.cat([flags, failed, window_slots(self.info, own_s, wall_s)]))
        self.cadence.agreed(step)
        if summed[len(flags)] > 0:
            self.failures.agree(self.info)         # every rank raises the same DiskError
        own, wall_s = own_times(summed[len(flags) + 1:], self.info.world_size)
        self.cadence.measured(wall_s)
        judged = [reader.window_read(WindowFigures(own, wall_s, self.steps)) for reader in self.readers]
        if any(judged):
            self.clock.judged()
        return self.preempt.signal_of(summed[:len(flags)])

    def _rates(self) -> dict[str, float]:
        """The window's rates; its figures are fixed for the next window's collective. On a GPU the host only queues
        the steps, so the window's CUDA-event time (Throughput's) is their time, and their own time the device
        clock's (its steps' time to their last gradient; none timed yet: 0, a window not judged)."""
        rates, steps = self.meter.rates(), self.meter.steps
        if self.meter.cuda:
            wall = rates["step_time_s"] * steps
            waits = wall * rates.get("sync_wait_frac", 0.0)
            if self.device_clock is not None:
                seconds, timed = self.device_clock.take()
                waits = max(wall - seconds / timed * steps, 0.0) if timed else wall
            self.clock.add(wall, waits, steps)
        self.clock.mark()
        if not self.log_cfg.measure_sync:
            rates.pop("sync_wait_frac", None)
        rates["samples_per_s"] *= self.info.world_size  # every rank runs at the same pace
        self.meter.reset()
        return rates

    def _log(self, epoch: int, step: int) -> None:
        """One train record: the window's losses, read just before (a window's one host sync)."""
        loss_sum, count = self.losses.take_window()
        fields = {k: v for reader in self.readers for k, v in reader.take_fields().items()}
        metrics = dict(loss=loss_sum / max(count, 1), lr=self.run.scheduler.get_last_lr()[0], **self._rates(),
                       **self.stats.snapshot(self.run.device), **fields)
        log.info("epoch %d step %d loss %.5f lr %.3e %.1f samples/s", epoch, step, metrics["loss"], metrics["lr"],
                 metrics["samples_per_s"])
        self.writer.write("train", epoch, step, metrics)
        self.record, self.logged_at = metrics, step

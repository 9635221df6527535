"""The epoch loop: the steps of an epoch, one code path for single process, DataParallel and DDP; how a step is
executed is the run's step strategy (trainer/engine/steps.py). After each optimizer step it calls the run's
components (trainer/engine/callbacks.py) until one says stop; everything else a run does between steps is one of
them. The run's owner (trainer/engine/trainer.py) builds it at fit(); so does an instrument:

    epoch_loop = EpochLoop(run, state, Throughput(run.device), TrainLosses(run.device, info, 10, state))
    for micro, batch in enumerate(epoch_loop.batches(epoch=0, start=0)):
        epoch_loop.step(batch, micro)          # True when it ended an optimizer step
    epoch_loop.losses.read()                   # the losses kept on the device, read once
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

from trainer.engine.build import Run, rank_seed
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.engine.capabilities import Batching, EpochPlan, of
from trainer.engine.loader import device_batches, make_loader
from trainer.engine.meters import Throughput
from trainer.engine.state import TrainState
from trainer.engine.window import NonFiniteLossError, TrainLosses

__all__ = ["EpochLoop", "NonFiniteLossError", "Stop"]

log = logging.getLogger(__name__)


class EpochLoop:
    """The steps of an epoch: micro-batches, accumulation, optimizer steps, then the components at each step's end."""

    def __init__(self, run: Run, state: TrainState, meter: Throughput, losses: TrainLosses,
                 components: Sequence[Component] = ()):
        self.run, self.state, self.meter, self.losses = run, state, meter, losses
        self.components = tuple(components)
        self.end = run.micro_per_epoch    # the micro-batch index where the current epoch ends (see batches)
        self.first = (0, 0)               # (micro-batch, sample) where this epoch's part in this process began
        self.waited = 0.0                 # the current step's wait in gradient collectives (when timed)
        state.layout = [run.info.world_size, run.batch_size, run.accum]

    def train_epoch(self, epoch: int) -> Stop | None:
        """Run (the rest of) one epoch, until its end (None) or a component's Stop."""
        start, run = self.state.batch_in_epoch, self.run
        loader = self.batches(epoch, start)
        run.wrapped.train()
        for component in self.components:
            component.epoch_start(epoch, start, self.end)
        stop, t_step = None, time.perf_counter()
        for micro, batch in enumerate(self.meter.timed(loader), start=start):
            if micro % run.accum == 0 or micro == start:
                run.phases.tell("step_start", epoch, micro)
            if not self.step(batch, micro):
                continue
            step = StepEnd(epoch, micro + 1, self.end, self.state.global_step, time.perf_counter() - t_step,
                           self.waited)
            self.meter.update(0, steps=1)
            self._advance(micro + 1)
            self.waited = 0.0
            stop = next((s for c in self.components if (s := c.step_end(step)) is not None), None)
            if stop is not None:
                break
            t_step = time.perf_counter()    # a periodic checkpoint at a step's end is not part of a step
        if (summary := run.step.epoch_summary()) is not None:
            log.info("%s (epoch %d)", summary, epoch + 1)
        for component in self.components:
            component.epoch_end(epoch, stop)
        return stop

    def step(self, batch: Any, micro: int) -> bool:
        """One micro-batch through the run's step strategy (trainer/engine/steps.py), and the optimizer step when
        it ends one (then True). Nothing here reads a device value."""
        done = self.run.step.micro_batch(batch, micro, self.end)
        self.losses.add(done.loss, done.samples, self.state.epoch, micro + 1)
        self.meter.update(done.samples, synced=done.synced, phases=done.phases)
        if done.synced is not None:
            self.waited += done.synced
        if done.stepped:
            self.state.global_step += 1
        return done.stepped

    def _advance(self, micro: int) -> None:
        """`micro` micro-batches of the epoch done: so many of this rank, and (over all ranks) so many samples of
        the epoch's permutation, where a resume goes on, in whatever layout it comes back."""
        state, (first, sample), run = self.state, self.first, self.run
        state.batch_in_epoch, state.batches_in_epoch = micro, self.end
        if run.sampler is not None:
            done = (micro - first) * run.batch_size * run.info.world_size
            state.sample_in_epoch = min(sample + done, run.sampler.size)

    def batches(self, epoch: int, start: int):
        """This rank's batches of the epoch from micro-batch `start` (sample `state.sample_in_epoch`) on: the
        recipe's plan or the sampler's. Sets where the epoch ends (self.end)."""
        run = self.run
        with run.phases.long("recipe.epoch_batches"):
            plan = of(run.recipe, EpochPlan).epoch_batches(epoch)
        if plan is not None:
            self.end = len(plan)
            return (plan[i] for i in range(start, len(plan)))
        self.first = (start, self.state.sample_in_epoch)
        run.sampler.set_epoch(epoch, self.state.sample_in_epoch)
        self.end = start + math.ceil(run.sampler.per_rank / run.batch_size)
        if run.device_data is not None:
            return device_batches(run.device_data, run.sampler, run.batch_size, epoch, run.device)
        return make_loader(run.train_set, run.sampler, run.batch_size, run.cfg.train.num_workers,
                           of(run.recipe, Batching).collate_fn(), rank_seed(run.cfg.seed, run.info.rank, epoch),
                           pin_memory=run.device.type == "cuda")

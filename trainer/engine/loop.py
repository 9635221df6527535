"""The epoch loop: the steps of an epoch, one code path for single process, DataParallel and DDP. After each
optimizer step it calls the run's components (trainer/engine/callbacks.py) until one says stop; everything else a
run does between steps (the logging window, the signal agreement, checkpoints, the straggler watch, ...) is one of
them. The run's owner (trainer/engine/trainer.py) builds it through its FitLoop; so does an instrument:

    epoch_loop = EpochLoop(run, state, Throughput(run.device), TrainLosses(run.device, info, 10, state))
    for micro, batch in enumerate(epoch_loop.batches(epoch=0, start=0)):
        epoch_loop.step(batch, micro)          # True when it ended an optimizer step
    epoch_loop.losses.read()                   # the losses kept on the device, read once
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.engine.build import Run, rank_seed
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.engine.loader import device_batches, make_loader
from trainer.engine.meters import Throughput
from trainer.engine.recipe import move_to
from trainer.engine.state import TrainState
from trainer.engine.step_graph import StepGraph
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
        self.waited = 0.0                 # the current step's wait in gradient collectives (train.measure_sync)
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
        if run.step_graph is not None:
            log.info("%s (epoch %d)", run.step_graph.summary(), epoch + 1)
        for component in self.components:
            component.epoch_end(epoch, stop)
        return stop

    def step(self, batch: Any, micro: int) -> bool:
        """One micro-batch, and the optimizer step when it ends an accumulation window (then True). Nothing
        here reads a device value: the path a CUDA step takes queues its kernels without waiting."""
        if self.run.cfg.train.step_graph == "on":
            self.meter.update(self._graphed_step(batch, micro))
            return True
        self.meter.update(self._micro_step(batch, micro))
        if (micro + 1) % self.run.accum and micro + 1 != self.end:
            return False
        self._optimizer_step()
        return True

    def _window_len(self, micro: int) -> int:
        """Micro-batches in the accumulation window holding `micro` (the last one may be short)."""
        start = micro - micro % self.run.accum
        return min(self.run.accum, self.end - start)

    def _micro_step(self, batch: Any, micro: int) -> int:
        """Forward/backward of one micro-batch; gradients sync only on the window's last one. Its loss stays
        on the device (self.losses); returns its samples."""
        run = self.run
        last = (micro + 1) % run.accum == 0 or micro + 1 == self.end
        sync = contextlib.nullcontext() if last or not isinstance(run.wrapped, DDP) else run.wrapped.no_sync()
        run.phases.mark("batch")
        batch = move_to(batch, run.device)
        if run.device_clock is not None:
            run.device_clock.step_start()
        t0 = time.perf_counter()
        run.recipe.before_step(batch)
        run.phases.mark("forward")         # before DDP's forward, whose buffer broadcast is a collective
        with sync:
            with run.autocast():
                loss = run.train_step(batch)
            run.recipe.after_step()
            run.phases.mark("backward")
            t1 = time.perf_counter()
            run.scaler.scale(loss / self._window_len(micro)).backward()
            if last and run.grad_sync is not None:
                run.grad_sync()
        if run.cfg.train.measure_sync:        # where a DDP step's time beyond one rank's goes (bench/run.py)
            self.meter.update(0, phases={"forward": t1 - t0, "backward": time.perf_counter() - t1})
        if run.sync_timer is not None:
            waited = run.sync_timer.take()
            self.waited += waited
            self.meter.update(0, synced=waited)
        n = run.recipe.batch_size_of(batch)
        self.losses.add(loss, n, self.state.epoch, micro + 1)
        return n

    def _graphed_step(self, batch: Any, micro: int) -> int:
        """train.step_graph=on: one whole optimizer step through the run's StepGraph (no accumulation: refused at
        build). The recipe's before/after_step stay outside the graph, as under train.compile."""
        run = self.run
        if run.step_graph is None:      # made at the first step: after a resume loaded the optimizer's state
            run.step_graph = StepGraph(run, self._step_closure)
        run.phases.mark("batch")
        batch = move_to(batch, run.device)
        run.recipe.before_step(batch)
        run.phases.mark("forward")
        loss = run.step_graph.step(batch)
        run.recipe.after_step()
        n = run.recipe.batch_size_of(batch)
        self.losses.add(loss, n, self.state.epoch, micro + 1)
        run.scheduler.step()              # fills the learning-rate tensor the graph reads
        self.state.global_step += 1
        return n

    def _step_closure(self, batch: Any):
        """() -> loss: one optimizer step on `batch`, what a step graph captures. The gradients are set to None
        first, as the eager step leaves them: a parameter this step does not reach (KGAT's CF phase and its
        relations) keeps no zero gradient for the optimizer to move it by; under a capture the backward allocates
        them from the graph's pool, at the addresses every replay writes (torch's whole-network capture)."""
        run, clip = self.run, self.run.cfg.train.clip_grad_norm

        def closure() -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            with run.autocast(cache=False):
                loss = run.train_step(batch)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
            run.optimizer.step()
            return loss
        return closure

    def _optimizer_step(self) -> None:
        run, clip = self.run, self.run.cfg.train.clip_grad_norm
        if clip > 0:
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        if run.device_clock is not None:
            run.device_clock.step_end()
        self.state.global_step += 1

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
            plan = run.recipe.epoch_batches(epoch)
        if plan is not None:
            self.end = len(plan)
            return (plan[i] for i in range(start, len(plan)))
        self.first = (start, self.state.sample_in_epoch)
        run.sampler.set_epoch(epoch, self.state.sample_in_epoch)
        self.end = start + math.ceil(run.sampler.per_rank / run.batch_size)
        if run.device_data is not None:
            return device_batches(run.device_data, run.sampler, run.batch_size, epoch, run.device)
        return make_loader(run.train_set, run.sampler, run.batch_size, run.cfg.train.num_workers,
                           run.recipe.collate_fn(), rank_seed(run.cfg.seed, run.info.rank, epoch),
                           pin_memory=run.device.type == "cuda")

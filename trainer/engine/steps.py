"""How an optimizer step is executed, chosen once per run (build.py's build_run): the eager step (micro-batches,
accumulation with DDP's no_sync, AMP's loss scaling, clipping) or the whole step replayed as one graph
(compile.step_graph=on, trainer/engine/step_graph.py). The epoch loop hands each micro-batch to the run's strategy
and counts what comes back; it never asks which one it has.

    strategy = step_strategy(run, compiled_step(recipe, run.wrapped, "off"), sync=None)
    done = strategy.micro_batch(batch, micro=0, end=8)     # MicroBatch: the loss on the device, samples, stepped
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config.settings import Config
from trainer.distributed.gradsync import GradSyncTimer
from trainer.engine.callbacks import Phases
from trainer.engine.capabilities import Batching, GPUShapedStep, of
from trainer.engine.recipe import Recipe, move_to
from trainer.engine.step_graph import StepGraph

log = logging.getLogger(__name__)

TrainStep = Callable[[Any], torch.Tensor]       # batch -> the recipe's loss on the wrapped model


class Run(Protocol):
    """What a step takes from its run (trainer/engine/build.py Run)."""

    cfg: Config
    recipe: Recipe
    model: torch.nn.Module
    wrapped: torch.nn.Module
    accum: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    phases: Phases

    @property
    def device(self) -> torch.device: ...

    def autocast(self, cache: bool = True) -> ContextManager: ...


@dataclass
class MicroBatch:
    """One micro-batch done: its loss (on the device, unread), its samples, whether it ended an optimizer step,
    and what it measured on the host (log.measure_sync: forward/backward seconds; seconds waiting in the
    gradient collectives, None where unmeasured)."""

    loss: torch.Tensor
    samples: int
    stepped: bool
    phases: dict[str, float] = field(default_factory=dict)
    synced: float | None = None


class StepStrategy(Protocol):
    measures_sync: bool             # its gradient collectives are timed (MicroBatch.synced)

    def micro_batch(self, batch: Any, micro: int, end: int) -> MicroBatch:
        """Micro-batch `micro` of an epoch whose micro-batches end at `end`; the optimizer step where it ends one."""

    def epoch_summary(self) -> str | None:
        """A line for the log at the epoch's end, or None."""


@dataclass
class GradSync:
    """How the ranks' gradients meet beside DDP (build.py _sync_gradients): `after_backward` averages them after
    the last micro-batch's backward (Recipe.average_after_backward), `timer` times the collectives
    (log.measure_sync, or the straggler watch on a CPU)."""

    after_backward: Callable[[], None] | None = None
    timer: GradSyncTimer | None = None


class EagerStep:
    """Forward and backward per micro-batch, gradients synced on an accumulation window's last one, then the
    optimizer step. Nothing here reads a device value: a CUDA step queues its kernels without waiting."""

    def __init__(self, run: Run, train_step: TrainStep, sync: GradSync):
        self.run, self.train_step, self.sync = run, train_step, sync
        self.host, self.batches = of(run.recipe, GPUShapedStep), of(run.recipe, Batching)   # looked up once
        self.measures_sync = sync.timer is not None
        self.phases_timed = run.cfg.log.measure_sync   # where a DDP step's time beyond one rank's goes

    def micro_batch(self, batch: Any, micro: int, end: int) -> MicroBatch:
        run = self.run
        last = (micro + 1) % run.accum == 0 or micro + 1 == end
        no_sync = contextlib.nullcontext() if last or not isinstance(run.wrapped, DDP) else run.wrapped.no_sync()
        run.phases.mark("batch")
        batch = move_to(batch, run.device)
        t0 = time.perf_counter()
        self.host.before_step(batch)
        run.phases.mark("forward")         # before DDP's forward, whose buffer broadcast is a collective
        with no_sync:
            with run.autocast():
                loss = self.train_step(batch)
            self.host.after_step()
            run.phases.mark("backward")
            t1 = time.perf_counter()
            window = min(run.accum, end - (micro - micro % run.accum))     # the last window may be short
            run.scaler.scale(loss / window).backward()
            if last and self.sync.after_backward is not None:
                self.sync.after_backward()
        done = MicroBatch(loss, self.batches.batch_size_of(batch), last)
        if self.phases_timed:
            done.phases = {"forward": t1 - t0, "backward": time.perf_counter() - t1}
        if self.sync.timer is not None:
            done.synced = self.sync.timer.take()
        if last:
            self._optimizer_step()
        return done

    def _optimizer_step(self) -> None:
        run, clip = self.run, self.run.cfg.optim.clip_grad_norm
        if clip > 0:
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()

    def epoch_summary(self) -> str | None:
        return None


class GraphedStep:
    """compile.step_graph=on: each micro-batch one whole optimizer step through a StepGraph (no accumulation: refused
    at build). The recipe's before/after_step stay outside the graph, as under compile.mode."""

    measures_sync = False

    def __init__(self, run: Run, train_step: TrainStep):
        self.run, self.train_step = run, train_step
        self.host, self.batches = of(run.recipe, GPUShapedStep), of(run.recipe, Batching)
        self.graph: StepGraph | None = None

    def micro_batch(self, batch: Any, micro: int, end: int) -> MicroBatch:
        run = self.run
        if self.graph is None:      # made at the first step: after a resume loaded the optimizer's state
            self.graph = StepGraph(run, self._closure)
        run.phases.mark("batch")
        batch = move_to(batch, run.device)
        self.host.before_step(batch)
        run.phases.mark("forward")
        loss = self.graph.step(batch)
        self.host.after_step()
        run.scheduler.step()              # fills the learning-rate tensor the graph reads
        return MicroBatch(loss, self.batches.batch_size_of(batch), True)

    def _closure(self, batch: Any) -> Callable[[], torch.Tensor]:
        """() -> loss: one optimizer step on `batch`, what a step graph captures. The gradients are set to None
        first, as the eager step leaves them: a parameter this step does not reach (KGAT's CF phase and its
        relations) keeps no zero gradient for the optimizer to move it by; under a capture the backward allocates
        them from the graph's pool, at the addresses every replay writes (torch's whole-network capture)."""
        run, clip = self.run, self.run.cfg.optim.clip_grad_norm

        def closure() -> torch.Tensor:
            run.optimizer.zero_grad(set_to_none=True)
            with run.autocast(cache=False):
                loss = self.train_step(batch)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
            run.optimizer.step()
            return loss
        return closure

    def epoch_summary(self) -> str | None:
        return self.graph.summary() if self.graph is not None else None


def step_strategy(run: Run, train_step: TrainStep, sync: GradSync) -> StepStrategy:
    """The run's one way of stepping (compile.step_graph)."""
    if run.cfg.compile.step_graph == "on":
        return GraphedStep(run, train_step)
    return EagerStep(run, train_step, sync)

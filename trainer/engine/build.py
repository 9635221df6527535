"""Building a run from a recipe and a config: data, model and its wrapper (DDP/DataParallel), then, for
training, sampler, optimizer, schedule and gradient scaler. Evaluation needs only the first half.

    run = build_run(recipe, info, cfg)              # training (trainer/engine/loop.py)
    run = build_for_eval(recipe, info, cfg)         # `trainer eval`: no optimizer, no sampler
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from trainer.config.settings import Config, ConfigError
from trainer.distributed import gradsync, runtime, stragglers
from trainer.distributed.runtime import DistInfo
from trainer.engine import footprint, step_graph
from trainer.engine.callbacks import Phases
from trainer.engine.capabilities import (
    Batching,
    DDPPolicy,
    DeviceData,
    DeviceResident,
    EpochPlan,
    GPUShapedStep,
    MemoryEstimate,
    OwnOptimizer,
    Prediction,
    of,
)
from trainer.engine.loader import ResumableSampler, per_rank_batch_size
from trainer.engine.optim import build_optimizer, build_scheduler, scaled_lr
from trainer.engine.recipe import Recipe
from trainer.engine.steps import GradSync, StepStrategy, TrainStep, step_strategy
from trainer.native import memory

log = logging.getLogger(__name__)


def rank_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from (seed, rank, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


# torch 2.13 names DDP's buffer broadcast forward_sync_buffers (broadcast_buffers warns there); the torch of a GPU
# node's own image may be older (2.11 knows only broadcast_buffers)
DDP_SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters \
    else "broadcast_buffers"


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def wrap_model(model: torch.nn.Module, info: DistInfo, dist_cfg, find_unused: bool = False,
               broadcast_buffers: bool = True, ddp: bool = True) -> torch.nn.Module:
    """DDP for a world > 1 (the plain module where the loop averages the gradients itself: ddp=False),
    DataParallel for --strategy dp on several GPUs, else the plain module."""
    if info.distributed:
        if dist_cfg.strategy != "ddp":
            raise ValueError(f"--strategy {dist_cfg.strategy} with a world of {info.world_size} processes.\n"
                             f"HINT: use --strategy ddp under srun/torchrun, or launch one process.")
        if not ddp:
            return model
        ids = [info.torch_device.index] if info.device.startswith("cuda") else None
        return DDP(model, device_ids=ids, find_unused_parameters=dist_cfg.find_unused_parameters or find_unused,
                   **{DDP_SYNC_BUFFERS: broadcast_buffers})
    if dist_cfg.strategy == "dp":
        if len(info.dp_devices) < 2:
            log.warning("--strategy dp needs two or more CUDA devices (%s): using one device (%s)",
                        f"--gpu-ids {list(info.dp_devices)}" if info.dp_devices else "no CUDA here", info.device)
            return model
        return torch.nn.DataParallel(model, device_ids=list(info.dp_devices))
    return model


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype of --amp on this device; auto: bf16 where the GPU supports it, else fp16; None on CPU."""
    if mode == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


@dataclass
class Run:
    """What one training or evaluation run is made of."""

    recipe: Recipe
    info: DistInfo
    cfg: Config
    train_set: Dataset
    eval_sets: dict[str, Dataset]
    model: torch.nn.Module            # the plain module (checkpoints, recipe attributes)
    wrapped: torch.nn.Module          # what the forward passes go through (DDP / DataParallel / the module)
    batch_size: int                   # per rank
    amp_dtype: torch.dtype | None
    accum: int = 1
    sampler: ResumableSampler | None = None
    micro_per_epoch: int = 0
    steps_per_epoch: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: torch.amp.GradScaler | None = None
    phases: Phases = field(default_factory=Phases)   # where the run is, for the components that listen
    device_data: DeviceData | None = None   # Recipe.device_dataset: the training set on the device (no DataLoader)
    step: StepStrategy | None = None  # how an optimizer step is executed (trainer/engine/steps.py), chosen once
    footprint: footprint.Footprint | None = None     # the model's memory estimate, None if none

    @property
    def device(self) -> torch.device:
        return self.info.torch_device

    @property
    def eval_model(self) -> torch.nn.Module:
        """DataParallel spreads evaluation batches too; under DDP every rank evaluates its own shard."""
        return self.wrapped if isinstance(self.wrapped, torch.nn.DataParallel) else self.model

    @property
    def eval_batch_size(self) -> int:
        return self.cfg.train.eval_batch_size or self.batch_size

    def autocast(self, cache: bool = True):
        """Mixed precision context for forward passes (a no-op with --amp off). cache=False inside a CUDA graph's
        capture, as torch asks (its cast weights would be the capture's)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=cache)


def _data_and_model(recipe: Recipe, info: DistInfo, cfg: Config, wrap: bool, training: bool = False) -> Run:
    if cfg.train.deterministic:
        runtime.deterministic_kernels()
    seed_everything(cfg.seed)  # same data and initial weights on every rank
    train_set, eval_sets = recipe.build_datasets()
    if len(train_set) == 0:
        raise ValueError(f"recipe {cfg.recipe}: the training split is empty "
                         f"(data.path={getattr(cfg.data, 'path', '')})")
    # after the data: a parse's temporaries go back to the system (with malloc keeping freed memory they would
    # stay resident for the whole run; 20M u.data rows parsed here: no child process to start, 2 s saved)
    if of(recipe, MemoryEstimate).reuse_freed_memory and memory.reuse_freed_memory():
        log.info("malloc keeps freed memory for reuse (no mmap): large tensors fault no pages after step one")
    fp = None
    if training:                # before a byte of it is taken: a model that cannot fit stops here (exit 4)
        fp = footprint.check_before_build(recipe, info)
    model = recipe.build_model().to(info.torch_device)
    seed_everything(rank_seed(cfg.seed, info.rank))  # per-rank dropout/sampling streams
    ddp = of(recipe, DDPPolicy)
    wrapped = wrap_model(model, info, cfg.dist, ddp.find_unused_parameters, ddp.broadcast_buffers,
                         not ddp.average_after_backward) if wrap else model
    run = Run(recipe, info, cfg, train_set, eval_sets, model, wrapped,
              per_rank_batch_size(cfg.train, info.world_size, info.replicas),
              amp_dtype(cfg.train.amp, info.torch_device))
    run.footprint = fp
    return run


def build_for_eval(recipe: Recipe, info: DistInfo, cfg: Config) -> Run:
    """Data and model only; DataParallel where asked (DDP is not needed to evaluate)."""
    return _data_and_model(recipe, info, cfg, wrap=not info.distributed)


def checkpoint_config(ckpt: dict, overrides: list[str]) -> Config:
    """The config a checkpoint was trained with, key=value overrides on top (`eval`, `predict`)."""
    from trainer.config.settings import from_dict, parse_override, set_key
    cfg = from_dict(ckpt["config"])
    for text in overrides:
        set_key(cfg, *parse_override(text), f"override {text!r}")
    return cfg


def loaded_for_eval(recipe: Recipe, info: DistInfo, cfg: Config, ckpt: dict, path) -> Run:
    """build_for_eval, with the checkpoint's weights, after checking that they fit this model and that its id
    maps are this data's."""
    import numpy as np

    from trainer.engine import ckpt_io
    run = build_for_eval(recipe, info, cfg)
    ckpt_io.check_compatible(ckpt, cfg.recipe, run.model, path)
    maps = of(run.recipe, Prediction).id_maps()
    ckpt_io.check_id_maps(ckpt, {k: torch.as_tensor(np.asarray(v)) for k, v in maps.items()}, path)
    run.model.load_state_dict(ckpt["model"])
    return run


def _sync_gradients(run: Run, comm) -> GradSync:
    """How the ranks' gradients meet: DDP's comm hook, or one all-reduce after the backward; timed with
    log.measure_sync."""
    # the straggler watch needs each step's wait on the CPU (trainer/distributed/stragglers.py; only measure_sync
    # logs it); on a GPU it reads the device clock (a component), and NCCL's steps go without a Python comm hook
    info, watch = run.info, stragglers.watched(run.info, run.cfg.faults.straggler_action)
    measure = run.cfg.log.measure_sync or (watch and run.device.type != "cuda")
    sync = GradSync()
    how = f"shared memory, {info.world_size} ranks on one host" if comm \
        else f"{info.backend} (no shared memory: {runtime.shm.attach.why})"
    if isinstance(run.wrapped, DDP):
        log.info("DDP's gradient all-reduce: %s", how)
        timer = gradsync.attach(run.wrapped, comm, timed=measure) if measure or comm is not None else None
    else:
        log.info("gradients averaged after the backward in one all-reduce: %s", how)
        timer = gradsync.GradSyncTimer(comm) if measure else None
        sync.after_backward = gradsync.after_backward(list(run.model.parameters()), info, timer)
    if measure:
        sync.timer = timer
    return sync


def compiled_step(recipe: Recipe, wrapped: torch.nn.Module, mode: str) -> TrainStep:
    """batch -> loss: the recipe's training step on the wrapped model, under torch.compile for compile.mode
    (reduce-overhead: also replayed as CUDA graphs where the shapes are static: the GPU-shaped step's)."""
    step = functools.partial(recipe.training_step, wrapped)
    if mode == "off":
        return step
    if not of(recipe, GPUShapedStep).gpu_shaped:
        log.warning("compile.mode=%s on the CPU-shaped step (packing, length buckets, host reads): expect graph "
                    "breaks and recompilations; train.gpu_path=on gives the fixed-shape step", mode)
    return torch.compile(step, mode=None if mode == "default" else mode, dynamic=False)


def build_run(recipe: Recipe, info: DistInfo, cfg: Config) -> Run:
    """Everything training needs, built in a fixed order (the RNG streams of a resumed run depend on it)."""
    tc, oc = cfg.train, cfg.optim
    run = _data_and_model(recipe, info, cfg, wrap=True, training=True)
    run.accum = max(tc.grad_accum_steps, 1)
    sync = _sync_gradients(run, runtime.local_comm()) if info.distributed else GradSync()
    run.device_data = of(recipe, DeviceResident).device_dataset()
    if run.device_data is not None:
        log.info("training set held on %s (%.1f MB): batches are gathers there, no DataLoader", info.device,
                 getattr(run.device_data, "nbytes", 0) / 2**20)
    run.sampler = ResumableSampler(len(run.train_set), info.rank, info.world_size, True, cfg.seed,
                                   of(recipe, Batching).sample_costs(), run.batch_size)
    plan = of(recipe, EpochPlan).epoch_batches(0)
    run.micro_per_epoch = len(plan) if plan is not None else math.ceil(run.sampler.per_rank / run.batch_size)
    run.steps_per_epoch = math.ceil(run.micro_per_epoch / run.accum)
    gpus = info.world_size * info.replicas      # what lr scaling counts: every GPU a batch is spread over
    run.optimizer = of(recipe, OwnOptimizer).build_optimizer(run.model, scaled_lr(oc.lr, oc.lr_scaling, gpus)) \
        or build_optimizer(run.model.parameters(), oc, gpus)
    run.scheduler = build_scheduler(run.optimizer, oc, tc, run.steps_per_epoch)
    run.scaler = torch.amp.GradScaler(run.device.type, enabled=run.amp_dtype == torch.float16)
    if cfg.compile.step_graph == "on" and (why := step_graph.refusal(run)):
        raise ConfigError(f"compile.step_graph=on: {why}")
    run.step = step_strategy(run, compiled_step(recipe, run.wrapped, cfg.compile.mode), sync)
    if of(recipe, GPUShapedStep).gpu_shaped and run.device.type == "cuda" and not tc.deterministic:
        torch.backends.cudnn.benchmark = True     # fixed shapes: each picks its fastest kernels once
    log.info("recipe=%s world=%d device=%s batch/rank=%d accum=%d steps/epoch=%d params=%d",
             cfg.recipe, info.world_size, info.device, run.batch_size, run.accum,
             run.steps_per_epoch, sum(p.numel() for p in run.model.parameters()))
    return run

"""The engine's config sections, one per owner: each names the part of the run that reads it (a section holds what
one owner decides, so a key is found where its behaviour is: docs/configuration.md, "Sections").

    train.*   the loop: epochs, batches, accumulation, evaluation, selection        trainer/engine/trainer.py, loop.py
    optim.*   the optimizer, its learning-rate schedule and clipping                   trainer/engine/optim.py, steps.py
    log.*     the logging window, progress bar, TensorBoard, per-rank logs, profiler   trainer/engine/components/
    faults.*  pre-flight checks, straggler watch, hang watch                           trainer/distributed/, components/
    compile.* torch.compile of the training step, the whole step as a CUDA graph       trainer/engine/steps.py
    ckpt.*    when checkpoints are written and how a run resumes                       trainer/engine/checkpointer.py
    dist.*    how processes and devices are used                                       trainer/distributed/
    search.*  the search trial a run is (set by hpc/submit.py --search)                components/search_trial.py

They live here, at the config's floor (docs/architecture.md, "Layers"), not in the owners' modules: a login node
builds, prints and checks a config without torch. ENGINE_RENAMED maps the keys of the one flat train.* section they
came from to their owners' keys; an old key still works, with a warning naming the new one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from trainer.config.bounds import FRACTION, POSITIVE, Bound
from trainer.config.ignored import Ignored


@dataclass
class TrainConfig:
    """The loop's settings (trainer/engine/trainer.py, loop.py, loader.py): how long, in which batches, evaluated
    when, and which checkpoint is the best."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        epochs=Bound(0, zero="no training: the initial weights are saved and evaluated"),
        max_steps=Bound(0, zero="no limit"), batch_size=POSITIVE,
        global_batch_size=Bound(0, zero="off: --batch-size is per rank"), grad_accum_steps=POSITIVE,
        eval_every_epochs=POSITIVE, eval_batch_size=Bound(0, zero="the training batch size"),
        early_stop_patience=Bound(0, zero="off"), num_workers=Bound(0, zero="load in the training process"))
    epochs: int = 10
    max_steps: int = 0                    # stop after this many optimizer steps (0: no limit)
    batch_size: int = 32                  # per rank (per GPU)
    global_batch_size: int = 0            # if > 0: split across ranks and accumulation steps
    grad_accum_steps: int = 1
    amp: Literal["off", "bf16", "fp16", "auto"] = "off"   # auto: bf16 (else fp16) on CUDA, off on CPU
    eval_every_epochs: int = 1
    eval_batch_size: int = 0              # per rank (0: the training batch size)
    early_stop_patience: int = 0          # epochs without improvement of the primary metric (0: off)
    # the validation metric that picks best.pt and drives early stopping ("": the recipe's; NAME or NAME:max|min)
    select_metric: str = ""
    num_workers: int = 0
    # the GPU-shaped step: fixed shapes, device-side sampling, no host sync (auto: on CUDA devices; on: forced,
    # e.g. on a CPU to test the path a GPU takes; off: the CPU path's packing, length buckets and C++ kernels)
    gpu_path: Literal["auto", "on", "off"] = "auto"
    # deterministic kernels (torch.use_deterministic_algorithms, cuDNN, CUBLAS_WORKSPACE_CONFIG): bitwise resume on
    # CUDA, at a cost (docs/gpu.md); an op with no deterministic kernel stops the run naming it
    deterministic: bool = False


@dataclass
class OptimConfig:
    """The optimizer, its learning-rate schedule and gradient clipping (trainer/engine/optim.py, steps.py; a recipe's
    own optimizer, Recipe.build_optimizer, gets the scaled lr)."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        lr=Bound(0, lo_open=True), momentum=Bound(0, 1), betas=FRACTION, min_lr_ratio=Bound(0, 1),
        clip_grad_norm=Bound(0, zero="no clipping"))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("momentum", 0.5, lambda s: s.name == "sgd", "optim.name=sgd"),
        Ignored("betas", [0.8, 0.99], lambda s: s.name != "sgd", "optim.name=adamw or adam", under=dict(name="sgd")),
        Ignored("min_lr_ratio", 0.1, lambda s: s.schedule != "constant", "optim.schedule=cosine or linear",
                under=dict(schedule="constant")),
    )
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9                 # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])   # adam/adamw
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"   # by world size
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0            # converted to steps; the larger of the two wins
    min_lr_ratio: float = 0.0             # floor of the decay, as a fraction of the peak lr
    clip_grad_norm: float = 0.0           # 0: no clipping


@dataclass
class LogConfig:
    """What a run reports while it trains (trainer/engine/components/logging_window.py, progress.py, profiler.py;
    trainer/engine/logging.py; TensorBoard in trainer/engine/meters.py)."""

    bounds: ClassVar[dict[str, Bound]] = dict(every_steps=POSITIVE)
    # the logging window: the ranks read their losses in one collective every so many optimizer steps
    every_steps: int = 10
    measure_sync: bool = False            # log forward/backward_frac; under DDP sync_wait_frac (collectives)
    progress: Literal["auto", "on", "off"] = "auto"   # tqdm bar on rank 0 (auto: when a terminal)
    per_rank: bool = False                # every rank also writes RUN_DIR/train.rank{N}.log (rank 0: train.log too)
    tensorboard: bool = True
    profile: str = ""                     # START:STOP: torch.profiler trace of those optimizer steps (RUN_DIR/profile)
    # rank 0's records also to these trackers (the mlflow, wandb extras), one tracking run per run directory kept
    # across requeues and resumes (trainer/engine/components/tracking.py); several at once: log.tracker=mlflow,wandb
    tracker: list[Literal["mlflow", "wandb"]] = field(default_factory=list)
    tracker_project: str = ""             # MLflow's experiment, W&B's project ("": the recipe's name)


@dataclass
class FaultsConfig:
    """How a run finds a broken, slow or stuck rank (trainer/distributed/preflight.py, stragglers.py;
    trainer/engine/components/stragglers.py, eviction.py, hang_watch.py)."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        preflight_slow=Bound(0, 1, hi_open=True, zero="the site's TRAINER_PREFLIGHT_SLOW, else 0.5"),
        # below 0 turns the watch off (the flat section's default bound, >= 0, refused the documented -1)
        hang_timeout_s=Bound(None, zero="auto, max(60 s, 20 x the slowest step); below 0: off"))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("preflight_slow", 0.3, lambda s: s.preflight != "off", "faults.preflight=auto or on",
                under=dict(preflight="off")),)
    # device and link checks before the first step (trainer/distributed/preflight.py; auto: several ranks or a GPU)
    preflight: Literal["auto", "on", "off"] = "auto"
    # a host below this fraction of the other hosts' median (matmul, host all-reduce, links) is unfit; lower it where
    # nodes are shared with other work (0: the site's TRAINER_PREFLIGHT_SLOW, else 0.5)
    preflight_slow: float = 0.0
    # a rank slower than the others while training (trainer/distributed/stragglers.py): name it in the log and the
    # train records (warn), or also checkpoint and exit 5 so that the restart loop relaunches without its host
    straggler_action: Literal["warn", "evict", "off"] = "warn"
    # no rank of the group making progress (a step, an evaluation batch, a checkpoint) for this long is a hang: every
    # rank's stacks in RUN_DIR/hangs/, one culprit named alike by every rank, exit 6 for the restart loop to relaunch
    # (trainer/engine/components/hang_watch.py). 0: auto, max(60 s, 20 x the slowest step); below 0: off
    hang_timeout_s: float = 0.0


@dataclass
class CompileConfig:
    """How the training step is compiled (trainer/engine/steps.py, build.py's compiled_step, step_graph.py)."""

    mode: Literal["off", "default", "reduce-overhead"] = "off"   # torch.compile of the model's training step
    # on: the whole optimizer step (forward, backward, clipping, optimizer) one CUDA graph per batch shape, replayed
    # (trainer/engine/step_graph.py; the GPU-shaped step, one rank, no accumulation; on a CPU the closure is replayed)
    step_graph: Literal["off", "on"] = "off"


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how a run resumes (trainer/engine/checkpointer.py, resume.py,
    components/periodic.py, preemption.py)."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        every_epochs=Bound(0, zero="never by epoch"), every_steps=Bound(0, zero="never by step"),
        keep_last=Bound(0, zero="keep every periodic checkpoint"),
        signal_latency_s=Bound(0, zero="agree at every step"))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("keep_last", 5, lambda s: s.every_epochs > 0 or s.every_steps > 0,
                "ckpt.every_epochs or ckpt.every_steps above 0 (periodic checkpoints to keep)",
                under=dict(every_epochs=0)),)
    every_epochs: int = 1                 # 0: never by epoch
    every_steps: int = 0                  # 0: never by step
    keep_last: int = 3                    # periodic checkpoints kept (best/final are separate)
    save_best: bool = True
    resume: str = ""                      # "" (fresh), "auto" (newest valid in run_dir), or a path
    init_from: str = ""                   # a fresh start takes its weights (only) from this checkpoint
    allow_data_change: bool = False       # a resume may go on with data other than the checkpoint's (logged)
    requeue_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGUSR2"])
    # ranks agree on a signal at each logging window and, between windows, every so many steps that a signal waits
    # at most this long (measured step time; until the first window: every step) before its checkpoint starts
    signal_latency_s: float = 5.0


@dataclass
class DistConfig:
    """How processes and devices are used (trainer/distributed/runtime.py, trainer/engine/build.py's wrap)."""

    bounds: ClassVar[dict[str, Bound]] = dict(timeout_s=Bound(0, lo_open=True))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("gpu_ids", [0, 1], lambda s: s.strategy == "dp", "dist.strategy=dp (--strategy dp)"),
        Ignored("find_unused_parameters", True, lambda s: s.strategy == "ddp", "dist.strategy=ddp",
                under=dict(strategy="single")),
        Ignored("shm_allreduce", "on", lambda s: s.strategy == "ddp" and s.backend != "nccl",
                "dist.strategy=ddp over gloo (dist.backend=auto or gloo)", under=dict(backend="nccl")))
    strategy: Literal["ddp", "dp", "single"] = "ddp"
    gpu_ids: list[int] = field(default_factory=list)     # DataParallel devices (default: all)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = 1800.0            # process-group timeout: a dead rank ends the others
    find_unused_parameters: bool = False
    shm_allreduce: Literal["auto", "on", "off"] = "auto"   # gloo on one host: all-reduce through shared memory


@dataclass
class SearchConfig:
    """The search trial this run is (trainer/engine/components/search_trial.py): its study's folder and number, set by
    the array task of hpc/submit.py --search (trainer/search/study.py); each validation is reported to the study
    and its pruner may end the run (exit 7, pruned: never retried). Empty: not a trial."""

    bounds: ClassVar[dict[str, Bound]] = dict(trial=Bound(-1))
    study: str = ""                      # the search's folder (its journal.log); "": not a trial
    trial: int = -1                      # the trial's number in that study


# the flat train.* keys -> their owners' keys (set_key warns once per key and source, then sets the new one)
ENGINE_RENAMED: dict[str, str] = {
    "train.optimizer": "optim.name",
    **{f"train.{key}": f"optim.{key}" for key in (
        "lr", "weight_decay", "momentum", "betas", "lr_scaling", "schedule", "warmup_steps", "warmup_epochs",
        "min_lr_ratio", "clip_grad_norm")},
    "train.log_every_steps": "log.every_steps", "train.log_per_rank": "log.per_rank",
    **{f"train.{key}": f"log.{key}" for key in ("measure_sync", "progress", "tensorboard", "profile")},
    **{f"train.{key}": f"faults.{key}" for key in (
        "preflight", "preflight_slow", "straggler_action", "hang_timeout_s")},
    "train.compile": "compile.mode", "train.step_graph": "compile.step_graph",
}

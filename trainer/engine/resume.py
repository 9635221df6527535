"""A resume under changed conditions: which settings may change (CHANGEABLE_ON_RESUME, refused otherwise
before anything is written), and where the run continues when the world size, batch size or accumulation
differs from the checkpoint's (the next unseen sample of the epoch, at the same point of the LR schedule).

    planned = check_resume_config(cfg, info, spec)   # before config.yaml, logs or TensorBoard are written
    planned.changes, planned.path              # what the resume changes; the checkpoint it loads (every rank)
    notes = continue_at(state, ckpt, run)      # in Checkpointer: place the epoch and the schedule
"""
from __future__ import annotations

import fnmatch
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainer.config.settings import Config, ConfigError, TrainConfig, from_dict, to_dict
from trainer.config.spec import RecipeSpec
from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine import ckpt_io
from trainer.engine.capabilities import EpochPlan, of
from trainer.engine.loader import per_rank_batch_size

log = logging.getLogger(__name__)

# The settings a resumed run may change; each applies from the resume step on. Any other difference from the
# checkpoint's config (the model, the data, the optimizer's other settings, the seed, ...) is refused: the
# run would no longer be the one its checkpoints belong to. (docs: checkpoints and faults, "Changed settings")
CHANGEABLE_ON_RESUME = (
    "run_dir", "private",
    "train.epochs", "train.max_steps", "train.batch_size", "train.global_batch_size", "train.grad_accum_steps",
    "train.num_workers", "train.eval_every_epochs", "train.eval_batch_size", "train.early_stop_patience",
    "train.gpu_path", "train.select_metric",
    "optim.lr", "log.*", "compile.*", "faults.*",
    "ckpt.*", "dist.*", "data.cache", "data.cache_cap_gb",
    "data.path",        # a moved copy of the same data; other data is refused by the checkpoint's data fingerprint
)
QUIET = ("ckpt.resume", "run_dir")     # differ on every resume or move: not worth a line


def changeable_keys(spec: RecipeSpec) -> tuple[str, ...]:
    """The engine's CHANGEABLE_ON_RESUME and the recipe's own (RecipeSpec.resume_changeable)."""
    return CHANGEABLE_ON_RESUME + tuple(spec.resume_changeable)


def changeable(key: str, patterns: tuple[str, ...] = CHANGEABLE_ON_RESUME) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this run's value) for every setting that differs."""
    try:
        before = flatten(to_dict(from_dict(saved, "the checkpoint's config")))   # renamed keys, new defaults
    except ConfigError as err:
        log.warning("cannot compare with the checkpoint's config (%s): taking this run's settings", err)
        return []
    now = flatten(to_dict(cfg))
    return [(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changes)


def resume_checkpoint(cfg: Config, damaged: list[Path] | None = None) -> tuple[Path, dict] | None:
    """The checkpoint --resume will load (rank 0): the newest valid one for auto, else the path given; with
    `damaged`, the checkpoints that do not load are named there instead of being moved aside."""
    spec = cfg.ckpt.resume
    if not spec:
        return None
    if spec == "auto":
        return ckpt_io.CheckpointFolder(cfg.run_dir, cfg.ckpt.keep_last).newest_valid(damaged)
    return Path(spec), ckpt_io.load(spec)


@dataclass
class Planned:
    """What check_resume_config found: the settings the resume changes, the checkpoint it loads (the same path on
    every rank; None for a fresh start) and, on rank 0, that checkpoint as already read for the check, so the
    Checkpointer neither searches for it nor reads it again (a large checkpoint was read three times)."""

    changes: list[tuple[str, Any, Any]]
    path: str | None = None
    ckpt: dict | None = None
    keep_previous: int | None = None    # rank 0: keep config.yaml as config.<this step>.yaml once nothing refuses
    damaged: list[Path] = field(default_factory=list)   # rank 0: checkpoints that do not load, moved aside then

    def take(self, path: str) -> dict | None:
        """The checkpoint read for the check if it is `path` (once: the memory is released after)."""
        ckpt, self.ckpt = self.ckpt, None
        return ckpt if path == self.path else None


def check_resume_config(cfg: Config, info: DistInfo, spec: RecipeSpec) -> Planned:
    """Before anything is written: refuse a resume that changes a setting outside CHANGEABLE_ON_RESUME (all
    ranks raise ConfigError); else return the changes (logged once the run directory may be written) with the
    checkpoint to load, and the step at which the previous config.yaml is to be kept (keep_previous_config,
    once the other checks passed too)."""
    problem, changes, path, ckpt, keep, damaged = None, [], None, None, None, []
    if info.is_main:
        try:
            found = resume_checkpoint(cfg, damaged)
            if found is not None:
                path, ckpt = str(found[0]), found[1]
                changes = config_changes(ckpt["config"], cfg) if ckpt["recipe"] == cfg.recipe else []
                allowed = changeable_keys(spec)
                refused = [c for c in changes if not changeable(c[0], allowed)]
                if ckpt["recipe"] != cfg.recipe:
                    problem = (f"{path} was written by recipe {ckpt['recipe']!r}; this run is {cfg.recipe!r}.\n"
                               f"HINT: point --resume/--run-dir at a run of the same recipe.")
                elif refused:
                    problem = (f"--resume from {path}: {describe(refused)} would change what this run is; these "
                               f"settings cannot change on resume.\nHINT: resume with the checkpoint's values, or "
                               f"start a new run with --run-dir NEW --init-from {path} (its weights only). "
                               f"Settings that may change: {', '.join(allowed)}.")
                elif changes:
                    keep = ckpt["global_step"]
        except ckpt_io.CheckpointError as err:
            problem = str(err)
    problem, changes, path = runtime.broadcast_object((problem, changes, path), info)
    if problem:
        raise ConfigError(problem)
    return Planned([c for c in changes if c[0] not in QUIET], path, ckpt, keep, damaged)


def keep_previous_config(run_dir: Path, step: int) -> None:
    """config.yaml will record the settings that run from now on: the previous one stays as config.<step>.yaml
    (the step from which it no longer held)."""
    current = run_dir / "config.yaml"
    if current.exists():
        current.replace(run_dir / f"config.{step}.yaml")


@dataclass(frozen=True)
class Layout:
    """How an epoch is cut: ranks, per-rank micro-batch, micro-batches per optimizer step."""

    world: int
    batch: int
    accum: int

    def __str__(self) -> str:
        return f"{self.world} rank(s) x batch {self.batch} x accumulation {self.accum}"


def saved_layout(ckpt: dict) -> Layout:
    """The layout a checkpoint was written under (format 2's `state.layout`; format 1: from its config, over the
    engine's defaults)."""
    stored = ckpt["state"].get("layout")
    if stored:
        return Layout(*stored)
    tc = SimpleNamespace(**{**asdict(TrainConfig()), **ckpt["config"].get("train", {})})
    world = int(ckpt["world_size"])
    return Layout(world, per_rank_batch_size(tc, world), max(int(tc.grad_accum_steps), 1))


def place_schedule(scheduler, step: int) -> None:
    """Put a LambdaLR at schedule step `step` (the lr of the next optimizer step)."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def apply_lr(scheduler, fresh: list[float]) -> bool:
    """This run's (scaled) peak learning rates instead of the checkpoint's, from the current schedule step;
    True when they differ."""
    if list(scheduler.base_lrs) == list(fresh):
        return False
    scheduler.base_lrs = list(fresh)
    for group, lr in zip(scheduler.optimizer.param_groups, fresh):
        group["initial_lr"] = lr
    place_schedule(scheduler, scheduler.last_epoch)
    return True


def continue_at(state, ckpt: dict, run) -> list[str]:
    """After loading a checkpoint: where this run continues. Unchanged layout: exactly where it stopped.
    Otherwise from the next unseen sample of the interrupted epoch (the recipe's own batch plan: at the same
    fraction of the epoch, with a warning), at the schedule step that has the same share of the run behind it
    in this layout's steps. Returns what differs, for the log and metrics.jsonl."""
    before, now = saved_layout(ckpt), Layout(run.info.world_size, run.batch_size, run.accum)
    state.layout = [now.world, now.batch, now.accum]
    plan = of(run.recipe, EpochPlan).epoch_batches(state.epoch)
    if plan is None and not state.sample_in_epoch and state.batch_in_epoch:   # written before positions were samples
        state.sample_in_epoch = min(state.batch_in_epoch * before.batch * before.world, run.sampler.size)
    if before == now:
        return []
    notes = [f"layout changed on resume: {before} -> {now}"]
    if plan is not None:
        done = state.batch_in_epoch
        start = math.floor(done / state.batches_in_epoch * len(plan)) // now.accum * now.accum \
            if state.batches_in_epoch else 0
        notes.append(f"recipe {run.cfg.recipe} draws each epoch's batches from its own plan, which depends on the "
                     f"layout: epoch {state.epoch} continues at batch {start} of {len(plan)} of the new plan (the "
                     f"checkpoint was at {done} of {state.batches_in_epoch or '?'}); the rest of this epoch's samples "
                     f"are drawn afresh, so some may repeat and others be skipped in this epoch only")
        state.batch_in_epoch, state.batches_in_epoch = start, len(plan)
        done_steps = start // now.accum
    else:
        size = run.sampler.size
        run.sampler.set_epoch(state.epoch, state.sample_in_epoch)
        left = math.ceil(math.ceil(run.sampler.per_rank / now.batch) / now.accum)
        state.batch_in_epoch, state.batches_in_epoch = 0, 0
        done_steps = run.steps_per_epoch - left
        pad = f" (plus at most {now.world - 1} repeat(s) evening out the ranks)" if now.world > 1 else ""
        notes.append(f"epoch {state.epoch} continues at sample {state.sample_in_epoch} of {size}: every sample "
                     f"still to come is trained once{pad}")
    step = state.epoch * run.steps_per_epoch + done_steps
    place_schedule(run.scheduler, step)
    notes.append(f"LR schedule continues at step {step} of {schedule_total(run)} in this layout's steps")
    return notes


def schedule_total(run) -> int:
    total = run.steps_per_epoch * run.cfg.train.epochs
    return min(total, run.cfg.train.max_steps) if run.cfg.train.max_steps > 0 else total


def write_resume_record(writer, state, changes: list[tuple[str, Any, Any]], notes: list[str]) -> None:
    """What a resume changed, in metrics.jsonl (split "resume") beside the log's lines."""
    if changes or notes:
        writer.write("resume", state.epoch, state.global_step,
                     dict(changed={k: [old, new] for k, old, new in changes}, notes=notes))


"""One training run below the command line: its directory, its recipe, the process group around fit(), and the
exit code of how it ended. The entry (trainer/cli/commands.py) parses; hpc/task.py (submitit) calls run_train too.

    result, cfg = run_train(cfg, spec)     # cfg, spec = trainer.config.settings.configure(...): the resolved settings
    exit_code_of(result); exit_code_of_error(err)
    recipe = build_recipe(cfg, info, spec)  # the recipe object, given its own config sections
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from trainer.config.settings import Config, ConfigError, save_config
from trainer.config.spec import RecipeSpec
from trainer.data.download import DownloadError, check_data_path
from trainer.distributed import runtime
from trainer.distributed.environment import LaunchError, select_environment
from trainer.engine.ckpt_io import CheckpointError
from trainer.launch.exitcodes import (
    DONE,
    NON_FINITE,
    RESOURCE,
    UNFIT_HOST,
    USAGE,
    UnfitHostError,
    is_resource_error,
    record_exit,
    record_start,
)
from trainer.native.extras import MissingExtraError

log = logging.getLogger("trainer")
USAGE_ERRORS = (ConfigError, LaunchError, CheckpointError, DownloadError, ValueError, FileNotFoundError,
                MissingExtraError)


def resolve_run_dir(cfg, info) -> str:
    """--run-dir, else runs/<recipe>-<Slurm job id> (stable across requeues; srun steps after the first get
    .<step>, so concurrent steps of one allocation differ), else a timestamp."""
    if cfg.run_dir:
        return cfg.run_dir
    job, step = info.job_id, info.step_id
    suffix = f".{step}" if step not in (None, "0") else ""
    name = f"{cfg.recipe}-{job}{suffix}" if job else f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    return str(Path("runs") / runtime.broadcast_object(name, info))


def build_recipe(cfg, info, spec: RecipeSpec):
    """The recipe object, given only its own config sections."""
    return spec.recipe_class()(cfg.data, cfg.model, cfg.train, info, eval_cfg=cfg.eval, seed=cfg.seed,
                               loss_cfg=cfg.loss)


def run_train(cfg: Config, spec: RecipeSpec):
    """Train the resolved config `cfg` of the recipe `spec`; returns (FitResult, Config with its run directory).
    Every check that can refuse the run (settings, recipe, checkpoint format, data, weights' shapes, memory) comes
    before the first write into the run directory (its lock aside): commit() below, which fit() calls once the
    checkpoint is loaded."""
    from trainer.engine.logging import attach_run_log, hold_logging
    from trainer.engine.loop import fit
    from trainer.engine.resume import check_resume_config, describe, keep_previous_config
    from trainer.engine.rundir import claim_run_dir, make_private
    check_data_path(str(getattr(cfg.data, "path", "")))
    if cfg.private:
        make_private()          # before anything is created: logs, checkpoints, TensorBoard, caches
    info = runtime.init(select_environment(), cfg.dist)
    ok, lock, started = False, None, False
    try:
        cfg.run_dir = resolve_run_dir(cfg, info)
        lock = claim_run_dir(cfg.run_dir, cfg.ckpt.resume, info)
        planned = check_resume_config(cfg, info, spec)      # refused before a log line or config.yaml is written
        held = hold_logging(info)                       # the console now; train.log from commit() on

        def commit() -> None:
            """The run directory's first writes, now that nothing refused the run."""
            nonlocal started
            if cfg.private and info.is_main:
                make_private(cfg.run_dir)
            attach_run_log(info, cfg.run_dir, held, per_rank=cfg.train.log_per_rank)
            if planned.changes:
                log.warning("changed on resume: %s", describe(planned.changes))
            if info.is_main:
                if planned.keep_previous is not None:
                    keep_previous_config(Path(cfg.run_dir), planned.keep_previous)
                save_config(cfg, Path(cfg.run_dir) / "config.yaml")
            record_start(cfg.run_dir, info.rank)
            started = True

        if info.is_main and hasattr(cfg.data, "path") and not cfg.data.path:
            log.warning("data.path is empty: training on the recipe's generated data (set data.path=DIR, or "
                        "use a configs/<recipe>/<dataset>.yaml, for a real dataset)")
        recipe = build_recipe(cfg, info, spec)
        try:
            result = fit(recipe, info, cfg, planned, commit)
        except BaseException as err:
            if started:             # a refusal before commit() leaves the run directory as it was
                record_exit(cfg.run_dir, info.rank, exit_code_of_error(err), f"{type(err).__name__}: {err}"[:2000])
            raise
        record_exit(cfg.run_dir, info.rank, exit_code_of(result), result.status, result.status == "preempted")
        ok = True
    finally:
        runtime.teardown(info, clean=ok)
        if lock is not None:
            lock.release()
    return result, cfg


def exit_code_of(result) -> int:
    """A finished fit's exit code (trainer/launch/exitcodes.py): 0, or 128 + the signal of a checkpointed stop that was
    not requeued."""
    return 128 + result.signal if result.status == "preempted" and not result.requeued else DONE


def exit_code_of_error(err: BaseException) -> int:
    """The exit code main() gives an error: usage/configuration 2, a non-finite loss 3, a disk that cannot be
    written or a model that cannot fit 4, a host the pre-flight found unfit 5, anything else 1."""
    from trainer.engine.loop import NonFiniteLossError
    if isinstance(err, NonFiniteLossError):
        return NON_FINITE
    if is_resource_error(err):
        return RESOURCE
    if isinstance(err, UnfitHostError):
        return UNFIT_HOST
    if isinstance(err, USAGE_ERRORS) or no_deterministic_kernel(err):
        return USAGE
    return 1


def no_deterministic_kernel(err: BaseException) -> bool:
    """torch's refusal, under train.deterministic=true, of an op with no deterministic kernel: a setting that
    fails the same at every relaunch, so a usage error."""
    return isinstance(err, RuntimeError) and "does not have a deterministic implementation" in str(err)

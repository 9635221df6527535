"""One training run below the command line: its directory, its recipe, the process group around its owner (the
Trainer), and each rank's exit record. The entry (trainer/cli/commands.py) parses; hpc/task.py (submitit) calls
run_train too; trainer/engine/exits.py says what exit code an ending gives.

    result, cfg = run_train(cfg, spec)     # cfg, spec = trainer.config.settings.configure(...): the resolved settings
    recipe = build_recipe(cfg, info, spec)  # the recipe object, given its own config sections
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from trainer.config.data_source import check_generated_data
from trainer.config.settings import Config, save_config
from trainer.config.spec import RecipeSpec
from trainer.data.cache import evict_pending
from trainer.data.download import check_data_path
from trainer.distributed import runtime
from trainer.distributed.environment import select_environment
from trainer.engine.exits import exit_cause, exit_code_of, exit_of
from trainer.engine.logging import attach_run_log, hold_logging
from trainer.engine.result import FitResult
from trainer.engine.resume import check_resume_config, describe, keep_previous_config
from trainer.engine.rundir import claim_run_dir, commit_run_dir, make_private
from trainer.engine.trainer import Trainer
from trainer.launch.exitcodes import record_exit, record_start

log = logging.getLogger("trainer")


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
                               loss_cfg=cfg.loss, optim_cfg=cfg.optim)


def run_train(cfg: Config, spec: RecipeSpec) -> tuple[FitResult, Config]:
    """Train the resolved config `cfg` of the recipe `spec`; returns (FitResult, Config with its run directory).
    Every check that can refuse the run (settings, recipe, checkpoint format, data, weights' shapes, memory) comes
    before the first write into the run directory (its lock aside): commit() below, which the Trainer calls once
    the checkpoint is loaded."""
    check_data_path(str(getattr(cfg.data, "path", "")))
    env = select_environment()
    source = check_generated_data(cfg.data, env.name) or ""     # generated data under Slurm/submitit: only if asked
    note = f"trained on {source}" if source.startswith("generated") else ""
    if cfg.private:
        make_private()          # before anything is created: logs, checkpoints, TensorBoard, caches
    info = runtime.init(env, cfg.dist)
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
            commit_run_dir(cfg.run_dir, info, planned.damaged, lock)
            evict_pending()                      # the data cache's cap: nothing removed by a refused run
            attach_run_log(info, cfg.run_dir, held, per_rank=cfg.log.per_rank)
            if planned.changes:
                log.warning("changed on resume: %s", describe(planned.changes))
            if info.is_main:
                if planned.keep_previous is not None:
                    keep_previous_config(Path(cfg.run_dir), planned.keep_previous)
                save_config(cfg, Path(cfg.run_dir) / "config.yaml", note)
            record_start(cfg.run_dir, info.rank)
            started = True

        if info.is_main and hasattr(cfg.data, "path") and not cfg.data.path:
            log.warning("data.path is empty: training on the recipe's generated data (set data.path=DIR, or "
                        "use a configs/<recipe>/<dataset>.yaml, for a real dataset)")
        recipe = build_recipe(cfg, info, spec)
        try:
            trainer = Trainer(recipe, info, cfg, planned, commit)
            with trainer:           # not `with Trainer(...) as trainer`: a reader (and a walk of the calls) sees fit()
                result = trainer.fit_and_tell()
        except BaseException as err:
            if started:             # a refusal before commit() leaves the run directory as it was
                record_exit(cfg.run_dir, info.rank, exit_of(err).code, exit_cause(err))
            raise
        record_exit(cfg.run_dir, info.rank, exit_code_of(result), result.reason or result.status,
                    result.status == "preempted")
        ok = True
    finally:
        runtime.teardown(info, clean=ok)
        if lock is not None:
            lock.release(refused=not started)
    return result, cfg

"""Command-line entry: parse -> config -> environment -> process group -> recipe -> run.

    python -m trainer train --recipe toy --epochs 2 --run-dir runs/demo     # TRAINER_PLUGINS=tests.toy_recipe
    srun -N2 --ntasks-per-node=2 python -m trainer doctor
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from trainer.extras import MissingExtraError, exit_if_core_missing

try:
    from trainer.cli import flags_from_args, get_parser, parse_args
    from trainer.config import ConfigError, build_config, from_dict, parse_override, save_config, set_key
    from trainer.data.download import DownloadError, check_data_path
    from trainer.distributed import runtime
    from trainer.distributed.environment import LaunchError, select_environment
    from trainer.engine.ckpt_io import CheckpointError
    from trainer.exitcodes import DONE, NON_FINITE, USAGE, record_exit, record_start
except ModuleNotFoundError as err:              # a Python without the project's environment: say which to use
    exit_if_core_missing(err)

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


def build_recipe(cfg, info):
    """The recipe object, given only its own config sections."""
    from trainer.registry import get_spec
    return get_spec(cfg.recipe).recipe_class()(cfg.data, cfg.model, cfg.train, info, eval_cfg=cfg.eval, seed=cfg.seed,
                                                      loss_cfg=cfg.loss)


def run_train(args):
    """Train from parsed `train` arguments; returns (FitResult, resolved Config). Used by hpc/task.py."""
    from trainer.engine.logging import setup_logging
    from trainer.engine.loop import fit
    from trainer.engine.resume import check_resume_config, describe
    from trainer.engine.rundir import claim_run_dir, make_private
    cfg = build_config(args.recipe, args.config, flags_from_args(args), args.overrides)
    check_data_path(str(getattr(cfg.data, "path", "")))
    if cfg.private:
        make_private()          # before anything is created: logs, checkpoints, TensorBoard, caches
    info = runtime.init(select_environment(), cfg.dist)
    ok, lock = False, None
    try:
        cfg.run_dir = resolve_run_dir(cfg, info)
        lock = claim_run_dir(cfg.run_dir, cfg.ckpt.resume, info)
        planned = check_resume_config(cfg, info)        # refused before a log line or config.yaml is written
        if cfg.private and info.is_main:
            make_private(cfg.run_dir)
        setup_logging(info, cfg.run_dir, per_rank=cfg.train.log_per_rank)
        if planned.changes:
            log.warning("changed on resume: %s", describe(planned.changes))
        if info.is_main:
            save_config(cfg, Path(cfg.run_dir) / "config.yaml")
            if hasattr(cfg.data, "path") and not cfg.data.path:
                log.warning("data.path is empty: training on the recipe's generated data (set data.path=DIR, or "
                            "use a configs/<recipe>/<dataset>.yaml, for a real dataset)")
        recipe = build_recipe(cfg, info)
        record_start(cfg.run_dir, info.rank)
        try:
            result = fit(recipe, info, cfg, planned)
        except BaseException as err:
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
    """A finished fit's exit code (trainer/exitcodes.py): 0, or 128 + the signal of a checkpointed stop that was
    not requeued."""
    return 128 + result.signal if result.status == "preempted" and not result.requeued else DONE


def exit_code_of_error(err: BaseException) -> int:
    """The exit code main() gives an error: usage/configuration 2, a non-finite loss 3, anything else 1."""
    from trainer.engine.loop import NonFiniteLossError
    if isinstance(err, NonFiniteLossError):
        return NON_FINITE
    if isinstance(err, USAGE_ERRORS) or no_deterministic_kernel(err):
        return USAGE
    return 1


def no_deterministic_kernel(err: BaseException) -> bool:
    """torch's refusal, under train.deterministic=true, of an op with no deterministic kernel: a setting that
    fails the same at every relaunch, so a usage error."""
    return isinstance(err, RuntimeError) and "does not have a deterministic implementation" in str(err)


def cmd_train(args) -> int:
    if args.print_config:        # nothing is started, created or checked on disk: only the config is resolved
        import yaml

        from trainer.config import to_dict
        cfg = build_config(args.recipe, args.config, flags_from_args(args), args.overrides)
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    result, _ = run_train(args)
    return exit_code_of(result)


def eval_checkpoint(path: str, overrides: list[str]) -> Path:
    """--checkpoint: a checkpoint file, or a run directory (its best.pt, else final.pt). Paths among the
    overrides mean a shell glob matched several: refused by name rather than taken for the first."""
    from trainer.engine import ckpt_io
    globbed = [o for o in overrides if "=" not in o and Path(o).exists()]
    if globbed:
        raise ckpt_io.CheckpointError(f"--checkpoint matched {len(globbed) + 1} paths ({', '.join([path, *globbed])}): "
                                      f"a glob of the shell, most likely.\nHINT: name one run directory or file.")
    given = Path(path)
    if not given.is_dir():
        return given
    folder = given / "checkpoints" if (given / "checkpoints").is_dir() else given
    for name in ("best.pt", "final.pt"):
        if (folder / name).is_file():
            return folder / name
    return given        # ckpt_io.load says what the directory holds


def cmd_eval(args) -> int:
    from trainer.engine import ckpt_io
    from trainer.engine.build import build_for_eval
    from trainer.engine.evaluation import evaluate_split, metrics_table
    from trainer.engine.logging import setup_logging
    path = eval_checkpoint(args.checkpoint, args.overrides)
    ckpt = ckpt_io.load(path)
    cfg = from_dict(ckpt["config"])
    for text in args.overrides:
        set_key(cfg, *parse_override(text), f"override {text!r}")
    info = runtime.init(select_environment(), cfg.dist)
    ok = False
    try:
        setup_logging(info)
        if info.is_main:
            log.info("evaluating %s (%s checkpoint, step %d)", path, ckpt.get("kind", "?"), ckpt["global_step"])
        run = build_for_eval(build_recipe(cfg, info), info, cfg)
        ckpt_io.check_compatible(ckpt, cfg.recipe, run.model, path)
        run.model.load_state_dict(ckpt["model"])
        splits = [s for s in args.splits.split(",") if s in run.eval_sets]
        results = {split: evaluate_split(run, split) for split in splits}
        ok = True
    finally:
        runtime.teardown(info, clean=ok)
    if info.is_main:
        report = dict(checkpoint=str(path), kind=ckpt.get("kind"), step=ckpt["global_step"], **results)
        print(f"{path} ({ckpt.get('kind', '?')} checkpoint, step {ckpt['global_step']})")
        print(metrics_table(results))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            print(f"every metric: {args.out}")
    return 0


def cmd_doctor(args) -> int:
    from trainer.doctor import run_doctor
    return run_doctor(args)


def cmd_data(args) -> int:
    from trainer.data.cli import run
    return run(args)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "doctor": cmd_doctor, "data": cmd_data}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(get_parser(), argv)
    try:
        return COMMANDS[args.command](args)
    except USAGE_ERRORS as err:
        record_for_agent(err)
        print(f"error: {err}", file=sys.stderr)
        return USAGE
    except ArithmeticError as err:
        from trainer.engine.loop import NonFiniteLossError
        record_for_agent(err)
        if not isinstance(err, NonFiniteLossError):      # a bug, not a diverged run: keep the traceback
            raise
        print(f"error: {err}", file=sys.stderr)
        return NON_FINITE
    except Exception as err:
        record_for_agent(err)
        if not no_deterministic_kernel(err):
            raise
        print(f"error: train.deterministic=true: {str(err).split(', but you set')[0]}.\n"
              f"HINT: train.deterministic=false trains with it (a resume is then not bitwise on CUDA: docs/gpu.md)",
              file=sys.stderr)
        return USAGE


def record_for_agent(err: BaseException) -> None:
    """Under torchrun, write the error where its agent looks (TORCHELASTIC_ERROR_FILE, as the elastic
    `record` decorator does), so its failure summary names the root cause and not only an exit code.
    Call it inside the `except` block: the traceback is taken from there."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        get_error_handler().record_exception(err)


if __name__ == "__main__":
    sys.exit(main())

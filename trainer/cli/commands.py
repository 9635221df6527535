"""The commands of `python -m trainer`: train, eval, predict, doctor, runs, data; main() parses and dispatches.

    python -m trainer train --recipe toy --epochs 2 --run-dir runs/demo     # TRAINER_PLUGINS=tests.toy_recipe
    main(["eval", "--checkpoint", "runs/demo"])
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from trainer.cli.parser import flags_from_args, get_parser, parse_args
from trainer.config.registry import get_spec
from trainer.config.settings import configure
from trainer.distributed import runtime
from trainer.distributed.environment import select_environment
from trainer.engine.exits import CRASH, exit_code_of, exit_of
from trainer.engine.session import build_recipe, run_train

log = logging.getLogger("trainer")


def cmd_train(args) -> int:
    cfg, spec = configure(args.recipe, args.config, flags_from_args(args), args.overrides)
    if args.print_config:        # nothing is started, created or checked on disk: only the config is resolved
        import yaml

        from trainer.config.settings import to_dict
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    result, _ = run_train(cfg, spec)
    return exit_code_of(result)


def cmd_eval(args) -> int:

    from trainer.engine import ckpt_io
    from trainer.engine.build import checkpoint_config, loaded_for_eval
    from trainer.engine.evaluation import evaluate_split, metrics_table
    from trainer.engine.logging import setup_logging
    path, ckpt = ckpt_io.checkpoint_for_eval(args.checkpoint, args.overrides)
    cfg = checkpoint_config(ckpt, args.overrides)
    info = runtime.init(select_environment(), cfg.dist)
    ok = False
    try:
        setup_logging(info)
        if info.is_main:
            log.info("evaluating %s (%s checkpoint, step %d)", path, ckpt.get("kind", "?"), ckpt["global_step"])
        run = loaded_for_eval(build_recipe(cfg, info, get_spec(cfg.recipe)), info, cfg, ckpt, path)
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
    from trainer.cli.doctor import run_doctor
    return run_doctor(args)


def cmd_data(args) -> int:
    from trainer.data.cli import run
    return run(args)


def cmd_predict(args) -> int:
    from trainer.engine.predict import run_predict
    return run_predict(args).code


def cmd_runs(args) -> int:
    from trainer.cli.runs import find_run_dirs, read_run
    from trainer.cli.runs_report import plot, render, rerun_text
    from trainer.engine.selection import selected_metric
    root = Path(args.dir)
    found = find_run_dirs(root)
    if not found:
        print(f"error: {root}: no run directory there (a folder with a metrics.jsonl or a claimed run's marker)",
              file=sys.stderr)
        return 2
    metric = selected_metric(args.metric, ("", "max")) if args.metric else None
    rows = [read_run(path, metric) for path in found]
    print(render(rows, args.format), end="")
    if args.plot:
        print(f"plot: {plot(rows, Path(args.plot))}", file=sys.stderr)
    if args.rerun_failed:
        print(rerun_text(rows, search=(root / "search.json").exists()), end="", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "predict": cmd_predict, "doctor": cmd_doctor, "data": cmd_data,
            "runs": cmd_runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(get_parser(), argv)
    try:
        return COMMANDS[args.command](args)
    except Exception as err:
        record_for_agent(err)
        ending = exit_of(err)            # trainer/engine/exits.py: the one table of exit codes
        record_for_restart_loop(ending.code, ending.message)
        if ending.code == CRASH:         # a bug, not a usage or resource error: keep the traceback
            raise
        print(f"error: {ending.message}", file=sys.stderr)
        return ending.code


def record_for_restart_loop(code: int, message: str) -> None:
    """Under the sbatch scripts' restart loop (slurm/common.sh exports RUN_DIR and TRAINER_ATTEMPT), an ending before
    the run wrote its own exit record (a refusal of the settings or the data, before the run directory is claimed) is
    recorded for the loop, which would otherwise read srun's 143 (the TERM it sent the other ranks) as a crash and
    relaunch a usage error. A record the run wrote itself for this attempt stays."""
    run_dir, attempt = os.environ.get("RUN_DIR"), os.environ.get("TRAINER_ATTEMPT")
    if not run_dir or attempt is None or not Path(run_dir).is_dir():
        return
    from trainer.launch.exitcodes import EXITS_DIR, RUNNING, record_exit
    try:
        rank = int(select_environment().rank or 0)
    except Exception:                   # noqa: BLE001 - the launch environment itself was the error
        rank = int(os.environ.get("SLURM_PROCID") or 0)
    try:
        own = json.loads((Path(run_dir) / EXITS_DIR / f"rank-{rank}.json").read_text())
        if own.get("attempt") == int(attempt) and own.get("kind") != RUNNING:
            return
    except (OSError, ValueError):
        pass
    record_exit(run_dir, rank, code, message[:2000])


def record_for_agent(err: BaseException) -> None:
    """Under torchrun, write the error where its agent looks (TORCHELASTIC_ERROR_FILE, as the elastic
    `record` decorator does), so its failure summary names the root cause and not only an exit code.
    Call it inside the `except` block: the traceback is taken from there."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler
        get_error_handler().record_exception(err)

"""THE argument parser of the trainer. hpc/submit.py reuses the train flags via `parents=`:

    parser = argparse.ArgumentParser(parents=[get_train_parser()])
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from trainer.config.registry import recipe_names, specs

# CLI flag (argparse dest) -> config key; flags sit between the YAML file and key=value overrides
FLAG_KEYS = {
    "epochs": "train.epochs", "batch_size": "train.batch_size",
    "global_batch_size": "train.global_batch_size", "grad_accum_steps": "train.grad_accum_steps",
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "warmup_epochs": "optim.warmup_epochs", "amp": "train.amp", "strategy": "dist.strategy",
    "gpu_ids": "dist.gpu_ids", "resume": "ckpt.resume", "init_from": "ckpt.init_from", "run_dir": "run_dir",
    "allow_data_change": "ckpt.allow_data_change",
    "seed": "seed", "private": "private",
}


CONFIG_SECTIONS = ("seed", "run_dir", "private", "train.*", "optim.*", "log.*", "faults.*", "compile.*", "ckpt.*",
                   "dist.*", "data.*", "model.*", "eval.*", "loss.*")


def flag_keys() -> dict[str, str]:
    """FLAG_KEYS plus the recipes' own flags (their specs' `flags`)."""
    extra = {f.name.lstrip("-").replace("-", "_"): f.key for s in specs() for f in s.tools.flags}
    return {**FLAG_KEYS, **extra}


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations: `--epoch 3` must not pass as `--epochs 3` (a typo of one flag silently
    taken for another); subcommands' parsers are of this class too (add_subparsers uses the parent's)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def options(self) -> list[str]:
        return [o for o in self._option_string_actions if o.startswith("--")]


def version_text() -> str:
    """`trainer --version`: the package version, the commit when run from a git checkout, torch, CUDA, NCCL."""
    import subprocess
    from pathlib import Path

    import torch

    from trainer.engine.ckpt_io import versions
    root = Path(__file__).resolve().parents[2]
    commit = ""
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    v = versions()
    return (f"hpc-trainer {v['trainer']}" + (f" (commit {commit})" if commit else "")
            + f"\ntorch {v['torch']}, CUDA {v['cuda']}, NCCL {nccl}, python {v['python']}")


class VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def _gpu_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-ids expects comma-separated integers, got {text!r}") from None


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `trainer train` (shared with hpc/submit.py)."""
    names = recipe_names()
    g = parser.add_argument_group("training")
    g.add_argument("--recipe", choices=names or None, metavar="NAME",
                   help=f"recipe to train: {', '.join(names) or '(none registered)'}")
    g.add_argument("--config", metavar="FILE", help="YAML file of overrides, e.g. configs/<recipe>/<dataset>.yaml; a "
                   "relative path is looked up in the working directory, then in the repository")
    g.add_argument("--epochs", type=int, help="number of epochs")
    g.add_argument("--batch-size", type=int, metavar="B", help="batch size per GPU / per rank")
    g.add_argument("--global-batch-size", type=int, metavar="G",
                   help="total batch size, split across ranks and accumulation steps (must divide)")
    g.add_argument("--grad-accum-steps", type=int, metavar="M", help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, help="peak learning rate (before --lr scaling, optim.lr_scaling)")
    g.add_argument("--weight-decay", type=float, help="weight decay")
    g.add_argument("--warmup-steps", type=int, help="linear warmup length in optimizer steps")
    g.add_argument("--warmup-epochs", type=float, help="linear warmup length in epochs")
    g.add_argument("--amp", choices=["off", "bf16", "fp16", "auto"],
                   help="mixed precision (fp16 uses a GradScaler; auto: bf16/fp16 on GPUs, off on CPUs)")
    g.add_argument("--strategy", choices=["ddp", "dp", "single"],
                   help="ddp: one process per GPU/rank; dp: DataParallel in one process; single")
    g.add_argument("--gpu-ids", type=_gpu_ids, metavar="0,1", help="GPUs for --strategy dp")
    g.add_argument("--resume", metavar="auto|PATH",
                   help="auto: newest valid checkpoint of --run-dir (fresh start if none); or a file")
    g.add_argument("--init-from", metavar="CKPT",
                   help="a fresh run starts from this checkpoint's weights (not its optimizer or step); "
                        "ignored when --resume finds a checkpoint")
    g.add_argument("--allow-data-change", action="store_const", const=True,
                   help="--resume may go on with data other than the checkpoint's (its files or counts differ); "
                        "logged as changed on resume")
    g.add_argument("--run-dir", metavar="DIR", help="output folder (default runs/<recipe>-<job id|time>)")
    g.add_argument("--seed", type=int, help="base seed (per-rank seeds are derived from it)")
    g.add_argument("--private", action="store_const", const=True,
                   help="run directory, checkpoints and logs readable by you only (umask 077; an existing "
                        "run directory is tightened), for shared file systems")
    for spec in specs():
        for flag in spec.tools.flags:
            g.add_argument(flag.name, type=flag.type, choices=flag.choices, help=f"{spec.name}: {flag.help}")
    g.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. optim.lr=0.01 data.path=DIR model.width=64")
    return parser


def get_train_parser(add_help: bool = False) -> argparse.ArgumentParser:
    """A parser holding only the train flags, for `parents=` in other tools."""
    return add_train_arguments(Parser(add_help=add_help))


def add_predict_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`trainer predict`'s arguments (hpc/submit.py predict takes the same)."""
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="a run directory (its best.pt, else final.pt) or a checkpoint file")
    parser.add_argument("--out", required=True, metavar="FILE", help="the output: FILE.csv or FILE.parquet")
    parser.add_argument("--data", metavar="PATH", help="the data to predict for (default: the checkpoint's data.path); "
                        "it needs no labels")
    parser.add_argument("--top-k", type=int, default=10, help="recommenders: items per user (default 10)")
    parser.add_argument("--users", metavar="FILE", help="recommenders: only these users (one id per line)")
    parser.add_argument("--keep-seen", action="store_true", help="recommenders: items the user has seen may be listed")
    parser.add_argument("--history", choices=("full", "train"), default="full",
                        help="sequential recommenders: score from every item of the user (full) or from its training "
                        "part (train)")
    parser.add_argument("--unknown-users", choices=("skip", "popular"), default="skip",
                        help="knowledge-graph recommenders: listed users the checkpoint never saw are skipped, or "
                        "given the most popular items")
    parser.add_argument("--part-size", type=int, default=4096, metavar="N",
                        help="units (users, videos) per part: what a requeued predict does not compute again")
    parser.add_argument("--parts", action="store_true", help="leave OUT.parts/ (the parts and their manifest) "
                        "instead of joining them into OUT")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT (and parts of another "
                        "prediction)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides (e.g. train.eval_batch_size=256 dist.timeout_s=600)")
    return parser


def get_parser() -> argparse.ArgumentParser:
    """`python -m trainer {train,eval,predict,doctor,runs,data}`."""
    parser = Parser(
        prog="trainer", description="Distributed PyTorch training for HPC clusters. Registered recipes: "
        + (", ".join(recipe_names()) or "none"))
    parser.add_argument("--version", action=VersionAction, help="package version, commit, torch, CUDA, NCCL")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", parents=[get_train_parser()], help="train a recipe",
                        description="Train a recipe. Config precedence: defaults < --config YAML < flags < key=value.",
                        epilog="Every config key of a recipe, with its default: python -m trainer train --recipe NAME "
                               "--print-config (sections: " + ", ".join(CONFIG_SECTIONS) + ").")
    tr.add_argument("--print-config", action="store_true",
                    help="print the fully resolved config (defaults < YAML < flags < key=value) as YAML and exit")
    ev = sub.add_parser("eval", help="evaluate a checkpoint on its validation and test splits")
    ev.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a run directory (its best.pt, else final.pt) or a checkpoint file")
    ev.add_argument("--splits", default="val,test", help="comma-separated splits (default val,test)")
    ev.add_argument("--out", metavar="FILE", help="write every metric as JSON to FILE (the terminal gets a table)")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (e.g. data.path=DIR)")
    pr = sub.add_parser("predict", help="turn a checkpoint into predictions (top-K items, labels) in a CSV or "
                        "Parquet file", description="Predictions of a checkpoint, on one process or many ranks "
                        "(torchrun, srun, hpc/submit.py): each rank writes its parts of OUT, rank 0 joins them; a "
                        "requeued predict continues from the parts already written.")
    add_predict_arguments(pr)
    doc = sub.add_parser("doctor", help="check the launch environment, devices and collectives")
    doc.add_argument("--json", action="store_true", help="print one JSON report (rank 0)")
    doc.add_argument("--bandwidth-mb", type=float, default=16.0, help="all_reduce size for the bandwidth test")
    doc.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds")
    doc.add_argument("--preflight", action="store_true", help="the training run's pre-flight checks alone (each "
                     "rank's matmul, memory, allocation; the all-reduce within hosts and across them); under srun: "
                     "a whole allocation; exit 5 names an unfit host")
    doc.add_argument("--run", metavar="RUN_DIR", help="instead: how a finished or failed run went (each rank's exit, "
                     "its relaunches and why, steps recomputed, seconds lost); starts no process group")
    runs = sub.add_parser("runs", help="a folder of run directories (a sweep's) as one table: the settings that "
                          "differ, each run's state, best epoch and metrics, best first",
                          description="Read every run directory under DIR (config.yaml, metrics.jsonl, its exit "
                          "record) and print one table; --plot draws the metric against each varied setting and the "
                          "best runs' validation curves.")
    runs.add_argument("dir", metavar="DIR", help="a sweep's --run-dir, or any folder of run directories")
    runs.add_argument("--format", choices=("table", "csv", "md"), default="table", help="the table's form "
                      "(default: aligned text)")
    runs.add_argument("--metric", metavar="NAME[:max|min]", help="sort and plot by this validation metric (default: "
                      "each run's selection metric, train.select_metric or the recipe's)")
    runs.add_argument("--plot", metavar="FILE.png", help="also draw the PNG (needs matplotlib: the bench extra)")
    runs.add_argument("--rerun-failed", action="store_true", help="print the array indices of the failed sweep "
                      "points and the hpc/submit.py option that submits them again")
    from trainer.data.cli import add_data_parser
    add_data_parser(sub)
    return parser


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{config key: value} for the flags that were given."""
    return {key: getattr(args, dest) for dest, key in flag_keys().items() if getattr(args, dest, None) is not None}


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               legacy_flags: bool | None = None) -> argparse.Namespace:
    """parse_args that also accepts key=value overrides between and after the flags, and (for `train` and
    hpc/submit.py) the seed guides' flags: aliases of the same meaning, or an error naming the replacement."""
    from trainer.legacy.flags import LegacyFlagError, strip_launcher_args, translate
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = strip_launcher_args(argv)
        if legacy_flags or (legacy_flags is None and argv[:1] == ["train"]):
            argv = translate(argv)
    except LegacyFlagError as err:
        parser.error(str(err))
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        sub = subcommand_parser(parser, args)
        sub.error(unrecognized(sub, stray or extra))
    if extra:
        args.overrides = list(args.overrides or []) + extra
    return args


def subcommand_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand that was given (its usage is the one to show), else `parser`."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        chosen = action.choices.get(getattr(args, action.dest, None) or "")
        if chosen is not None:
            return subcommand_parser(chosen, args)
    return parser


def unrecognized(parser: argparse.ArgumentParser, stray: list[str]) -> str:
    """'unrecognized argument --epcohs (did you mean --epochs?)' for each stray argument."""
    options = parser.options() if isinstance(parser, Parser) else list(parser._option_string_actions)
    said = []
    for arg in stray:
        if not arg.startswith("-"):
            said.append(f"{arg!r} is neither a flag nor a key=value override")
            continue
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        said.append(f"unrecognized argument {name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(said)

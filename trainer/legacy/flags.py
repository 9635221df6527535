"""The seed guides' flags: the ones that mean here what they meant there are accepted (as key=value
overrides); the others stop with the exact replacement. Launcher arguments (`--local-rank`) are checked.

    argv = translate(["train", "--use_amp"])      # LegacyFlagError: --use_amp ... use --amp bf16
"""
from __future__ import annotations

import os
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class LegacyFlagError(ValueError):
    """A seed flag with no same-meaning equivalent here; the message names the replacement."""


# seed flag -> (config key, fixed value or None when the flag takes one): the same meaning here
ALIASES: dict[str, tuple[str, str | None]] = {
    "--num_workers": ("train.num_workers", None),          # loader workers per process (per GPU)
    "--num-workers": ("train.num_workers", None),
    "--batch_size_per_gpu": ("train.batch_size", None),    # seed 000: per GPU, as --batch-size here
    "--maxlen": ("data.maxlen", None),
    "--warmup_steps": ("optim.warmup_steps", None),        # seed 001's troubleshooting table
    "--backend": ("dist.backend", None),
    "--no_mhc": ("model.mhc", "false"),
    "--no_time": ("model.time", "false"),
    "--mhc_no_amp": ("model.mhc_fp32", "true"),            # mHC maps stay fp32 under AMP
    "--multi_gpu": ("dist.strategy", "ddp"),               # seed 001: enable DDP
    "--multi-gpu": ("dist.strategy", None),                # seed 002: ddp | dp
}

# seed flag -> what to write instead (the meaning differs here, or the job is done elsewhere)
REPLACEMENTS: dict[str, str] = {
    "--use_amp": "--amp bf16 (or --amp fp16 on GPUs without bf16; --amp auto picks)",
    "--fp16": "--amp fp16 (seed 000's troubleshooting: half precision; --amp bf16 where the GPU has it)",
    "--batch_size": "--global-batch-size {value}: seed 001's --batch_size is the total over all GPUs "
                    "(--batch-size here is per GPU)",
    "--num_gpus": "torchrun --nproc-per-node {value} (one process per GPU), or --gpus-per-node {value} with "
                  "hpc/submit.py / sbatch",
    "--master_port": "export MASTER_PORT={value} (or torchrun --master-port {value})",
    "--train_dir": "--run-dir runs/{value}",
    "--save-dir": "--run-dir {value}",
    "--state_dict_path": "--init-from {value} (weights only) or --resume {value} (the whole training state)",
    "--inference_only": "python -m trainer eval --checkpoint RUN_DIR/checkpoints/best.pt",
}
LAUNCHER = ("--local-rank", "--local_rank")


def _split(arg: str) -> tuple[str, str | None]:
    name, eq, value = arg.partition("=")
    return name, (value if eq else None)


def dataset_replacement(name: str | None, recipe: str | None) -> str:
    """--dataset NAME -> the config file (and data folder) that select that dataset here."""
    found = sorted(CONFIGS.glob(f"*/{name}.yaml")) if name else []
    if recipe:
        found = [p for p in found if p.parent.name == recipe] or found
    if not found:
        return "--config configs/<recipe>/<dataset>.yaml data.path=data/<dataset>"
    return " or ".join(f"--config configs/{p.parent.name}/{p.name} data.path=data/{name}" for p in found)


def _takes_value(name: str) -> bool:
    return name == "--dataset" or (name in ALIASES and ALIASES[name][1] is None) \
        or name in REPLACEMENTS and name not in ("--use_amp", "--fp16", "--inference_only")


def translate(argv: list[str]) -> list[str]:
    """argv (launcher arguments already stripped) with the seed aliases turned into key=value overrides;
    LegacyFlagError for a refused flag."""
    out, i = [], 0
    recipe = next((argv[j + 1] for j, a in enumerate(argv[:-1]) if a == "--recipe"), None)
    while i < len(argv):
        name, value = _split(argv[i])
        i += 1
        if name not in ALIASES and name not in REPLACEMENTS and name != "--dataset":
            out.append(argv[i - 1])
            continue
        if _takes_value(name) and value is None and i < len(argv) and not argv[i].startswith("--"):
            value, i = argv[i], i + 1
        if name == "--inference_only" and str(value).lower() in ("false", "0"):
            continue                     # seed 001's resume command spells out the default: train
        elif name in ALIASES:
            key, fixed = ALIASES[name]
            if fixed is None and value is None:
                raise LegacyFlagError(f"{name} needs a value (here it sets {key})")
            out.append(f"{key}={fixed if fixed is not None else value}")
        else:
            shown = f"{name} {value}" if value is not None else name
            instead = dataset_replacement(value, recipe) if name == "--dataset" else \
                REPLACEMENTS[name].replace("{value}", value if value is not None else "N")
            raise LegacyFlagError(f"{shown} is a flag of the seed scripts; here use {instead}")
    return out


def strip_launcher_args(argv: list[str]) -> list[str]:
    """torch.distributed.launch puts --local-rank=N before the script's own arguments (even before the
    subcommand): checked against LOCAL_RANK and dropped."""
    out, i = [], 0
    while i < len(argv):
        name, value = _split(argv[i])
        i += 1
        if name not in LAUNCHER:
            out.append(argv[i - 1])
            continue
        if value is None and i < len(argv):
            value, i = argv[i], i + 1
        check_local_rank(name, value)
    return out


def check_local_rank(flag: str, value: str | None) -> None:
    """torch.distributed.launch passes --local-rank=N (without --use-env); it must agree with LOCAL_RANK."""
    if value is None or not value.lstrip("-").isdigit():
        raise LegacyFlagError(f"{flag} expects an integer, got {value!r}")
    env = os.environ.get("LOCAL_RANK")
    if env is not None and env != value:
        raise LegacyFlagError(f"{flag}={value} but LOCAL_RANK={env}: the launcher's two statements disagree")

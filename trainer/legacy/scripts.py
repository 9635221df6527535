"""The seed guides' scripts by name: `main.py`, `main_multi_gpu.py` and `train.py` at the repository root run the
trainer with the guide's meaning and say the command that does so here; `main.py`, the script of two guides
(001 SASRec/TiSASRec+mHC, 002 HAR), is told apart by its flags, and where they do not tell it stops with both
commands. The flags themselves go through the trainer's seed-flag layer (trainer/legacy/flags.py).

    torchrun --nproc_per_node=4 main_multi_gpu.py --multi-gpu ddp --epochs 20    # seed 002: HAR under DDP
"""
from __future__ import annotations

import os
import shlex
import sys

from trainer.legacy.flags import CONFIGS, LAUNCHER

# guide: (what it trains, the trainer arguments of its script before the user's own)
GUIDES = {
    "001": ("SASRec/TiSASRec+mHC", ["--config", "configs/tisasrec/ml-1m.yaml", "model.mhc=true"]),
    "002": ("HAR", ["--config", "configs/har/uci-har.yaml"]),
    "003": ("mouse-behaviour 3D CNN", ["--config", "configs/video/mouse.yaml"]),
}
SCRIPTS = {"main.py": ("001", "002"), "main_multi_gpu.py": ("002",), "train.py": ("003",)}
# seed 001's main.py spells its flags with underscores (--batch_size, --train_dir); seed 002's main.py takes these
# (dashed, like the trainer's own flags, which tell nothing: --print-config, --run-dir)
HAR_FLAGS = {"--batch-size", "--epochs", "--multi-gpu", "--gpu-ids", "--mode", "--save-dir", "--warmup-epochs",
             "--num-workers", "--weight-decay", "--grad-accum-steps"}
# inside a guide's own script its flags mean what the guide says (the trainer's command line refuses them,
# since there they would be read as its own flags): seed flag -> (the trainer's flag, its value; {} the seed's)
TRANSLATED = {
    "001": {"--train_dir": ("--run-dir", "runs/{}"), "--batch_size": ("--global-batch-size", "{}"),
            "--use_amp": ("--amp", "auto")},                  # auto: bf16, or fp16 where the GPU lacks bf16
    "002": {"--save-dir": ("--run-dir", "{}")},
}


def guide_of(script: str, argv: list[str]) -> str | None:
    """The guide whose script `script` is, given its arguments; None where they do not tell."""
    guides = SCRIPTS[script]
    if len(guides) == 1:
        return guides[0]
    names = {a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in LAUNCHER}
    if any("_" in n for n in names) or "--dataset" in names:
        return "001"
    return "002" if names & HAR_FLAGS else None          # --lr alone tells nothing: both guides have it


def trainer_args(guide: str, argv: list[str]) -> list[str]:
    """`train` with the guide's config, then the user's arguments, the guide's own flags translated (TRANSLATED);
    seed 001's --dataset NAME picks the config of that name (an unknown one is left for the trainer to refuse
    with the choices)."""
    head, rest, i, table = list(GUIDES[guide][1]), [], 0, TRANSLATED.get(guide, {})
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        takes_value = (name in table and "{}" in table[name][1]) or (guide == "001" and name == "--dataset")
        if takes_value and not eq and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if guide == "001" and name == "--dataset":
            if (CONFIGS / "tisasrec" / f"{value}.yaml").exists():
                head[1] = f"configs/tisasrec/{value}.yaml"
            else:
                rest.append(f"--dataset={value}")
        elif name in table:
            flag, template = table[name]
            rest += [flag, template.format(value)]
        else:
            rest.append(argv[i])
        i += 1
    # the repository's configs wherever the script is run from (shown relative from the repository root)
    if not os.path.exists(head[1]):
        head[1] = str(CONFIGS.parent / head[1])
    return ["train", *head, *rest]


def _shown(args: list[str]) -> str:
    launched = os.environ.get("LOCAL_WORLD_SIZE")
    prefix = f"torchrun --nproc-per-node {launched}" if launched else "python"
    shown = [a for a in args if a.split("=", 1)[0] not in LAUNCHER]     # the launcher's own --local-rank=N
    return f"{prefix} -m trainer {shlex.join(shown)}"


def run(script: str, argv: list[str]) -> int:
    """Run `script`'s guide through the trainer (its exit status), or stop (2) where the guide is unclear."""
    guide = guide_of(script, argv)
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    if guide is None:
        if first:
            lines = [f"  seed {g} ({GUIDES[g][0]}): {_shown(trainer_args(g, argv))}" for g in SCRIPTS[script]]
            print(f"error: {script} is the script of two guides and these flags do not tell which; here use\n"
                  + "\n".join(lines), file=sys.stderr)
        return 2
    args = trainer_args(guide, argv)
    if first:
        print(f"{script}: seed {guide}'s script ({GUIDES[guide][0]}); here the same is {_shown(args)}",
              file=sys.stderr)
    from trainer.cli.commands import main
    return main(args)

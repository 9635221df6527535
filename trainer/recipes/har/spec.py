"""HAR time-series classifier: what the trainer needs to know about this recipe (no torch imported here)."""
from __future__ import annotations

import argparse
import math

from trainer.config.spec import DataCommand, Dataset, Flag, RecipeSpec, RecipeTools
from trainer.recipes.har.config import HARDataConfig, HARLossConfig, HARModelConfig

UCI_SIZES = {"tiny": (450, 150), "uci-har": (7352, 2947)}     # train / test windows


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=list(UCI_SIZES), default="tiny",
                   help="tiny (600 windows) or uci-har (7352 train / 2947 test windows of 30 subjects)")


def _synth(args: argparse.Namespace) -> int:
    """Synthetic windows in the UCI HAR layout (9 signals x 128 samples, 6 activities, subjects)."""
    from trainer.recipes.har.prepare import write_synthetic_uci
    n_train, n_test = UCI_SIZES[args.preset]
    root = write_synthetic_uci(args.out, n_train, n_test, args.seed)
    print(f"wrote {n_train} train / {n_test} test windows (9 x 128) to {root}")
    return 0


SPEC = RecipeSpec(
    name="har",
    recipe="trainer.recipes.har.recipe:HARRecipe",
    summary="HAR time-series classifier (accelerometer/gyroscope windows)",
    data_config=HARDataConfig, model_config=HARModelConfig, loss_config=HARLossConfig,
    renamed={"model.hidden": "model.head_width", "model.embed_dim": "model.channel_width",
             "model.label_smoothing": "loss.label_smoothing"},
    defaults={"train.amp": "auto", "train.batch_size": 64, "train.epochs": 30, "optim.lr": 2e-3,
              "optim.weight_decay": 1e-2, "optim.warmup_epochs": 1.0},
    tools=RecipeTools(
        flags=(Flag("--mode", "model.mode", "channel fusion (model.mode): concatenate, average, or the first "
                    "channel only", choices=("flatten", "average", "first")),),
        synth=DataCommand("windows in the UCI HAR layout", _synth_arguments, _synth),
        datasets={"uci-har": Dataset("trainer.recipes.har.download:uci_har", "UCI HAR Dataset")},
    ),
)


# the benchmark harness's preset (bench/run.py): per-rank batch, fixed overrides, and data(n, out) -> the
# overrides that give at least n training samples; the synthetic cases' test and validation splits go by subject:
# about half of the cases train
BENCH = dict(batch=64, args=(),
             data=lambda n, out: [f"data.synthetic_cases={max(600, math.ceil(n / 0.5 * 1.1))}"])

"""The har recipe's config sections (no torch here: the CLI, config and hpc/submit.py read them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trainer.config.bounds import CACHE_CAP, FRACTION, POSITIVE, Bound
from trainer.config.ignored import Ignored, cached_only, generated_only


@dataclass
class HARDataConfig:
    """Where the windows come from and how they are split and normalised."""

    bounds: ClassVar[dict[str, Bound]] = dict(cache_cap_gb=CACHE_CAP,
                                              val_fraction=FRACTION, length=Bound(0, zero="the longest case"),
                                              synthetic_cases=POSITIVE, synthetic_channels=POSITIVE,
                                              synthetic_length=POSITIVE, synthetic_classes=Bound(2))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        cached_only(),
        *generated_only(synthetic_cases=120, synthetic_channels=3, synthetic_length=64, synthetic_classes=3))

    path: str = ""                    # UCI HAR folder, UEA folder (*_TRAIN.ts), arrays folder or file; "": synthetic
    synthetic: bool = False               # generated data on purpose: needed under Slurm/submitit (data.path "")
    format: Literal["auto", "uci-har", "ts", "arrays"] = "auto"
    cache: str = ""                   # the parsed-data cache of the text formats: "" ~/.cache/hpc-trainer/data, "off",
    # or a folder (trainer/data/cache.py)
    cache_cap_gb: float = 20.0        # past it, the least recently used entries no job maps are removed (0: no cap)
    val_fraction: float = 0.2         # of the training cases, when the dataset has no validation file
    val_split: Literal["auto", "subject", "stratified"] = "auto"   # auto: by subject where subjects are known
    require_all_classes: bool = False   # a class with no training case: refused (else named in a warning)
    standardize: bool = True          # per channel, statistics of the training split only
    length_mode: Literal["pad", "resample"] = "pad"
    length: int = 0                   # target length (0: the longest case; resample: the longest training case)
    synthetic_cases: int = 600        # synthetic data (data.path empty): cases, channels, length, classes
    synthetic_channels: int = 9
    synthetic_length: int = 128
    synthetic_classes: int = 6


@dataclass
class HARModelConfig:
    """Encoder, fusion and head."""

    bounds: ClassVar[dict[str, Bound]] = dict(width=POSITIVE, depth=POSITIVE, kernel_size=POSITIVE, patch=POSITIVE,
                                              heads=POSITIVE,
                                              channel_width=POSITIVE, head_width=Bound(0, zero="a linear head"),
                                              dropout=FRACTION)
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("kernel_size", 5, lambda s: s.encoder == "cnn", "model.encoder=cnn", under=dict(encoder="transformer")),
        Ignored("patch", 8, lambda s: s.encoder == "transformer", "model.encoder=transformer"),
        Ignored("heads", 2, lambda s: s.encoder == "transformer", "model.encoder=transformer"))

    mode: Literal["flatten", "average", "first"] = "flatten"
    encoder: Literal["cnn", "transformer"] = "cnn"
    width: int = 64                   # conv channels / transformer width
    depth: int = 3                    # conv blocks (each halves the length) / transformer layers
    kernel_size: int = 7
    patch: int = 16                   # transformer: samples per patch
    heads: int = 4
    channel_width: int = 64           # per-channel embedding E
    head_width: int = 128             # head hidden units (0: a linear head)
    dropout: float = 0.3


@dataclass
class HARLossConfig:
    """Cross-entropy over the classes."""

    bounds: ClassVar[dict[str, Bound]] = dict(label_smoothing=FRACTION)

    label_smoothing: float = 0.0

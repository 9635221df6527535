"""The video recipe's config sections (no torch here: the CLI, config and hpc/submit.py read them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from trainer.config.bounds import FRACTION, POSITIVE, Bound
from trainer.config.ignored import Ignored, generated_only


@dataclass
class VideoDataConfig:
    """Videos, annotations, frame cache, clips and the video-level split."""

    bounds: ClassVar[dict[str, Bound]] = dict(size=Bound(0, zero="as decoded"), clip_len=POSITIVE, clip_stride=POSITIVE,
                                              sample_every=POSITIVE, val_fraction=FRACTION, test_fraction=FRACTION,
                                              synthetic_videos=POSITIVE, synthetic_frames=POSITIVE,
                                              synthetic_classes=Bound(2))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        *(Ignored(key, 0.1, lambda s: not (s.val_videos or s.test_videos),
                  "no data.val_videos or data.test_videos (which name the split instead)",
                  under=dict(val_videos=["a.mp4"])) for key in ("val_fraction", "test_fraction")),
        *generated_only(synthetic_videos=4, synthetic_frames=30, synthetic_classes=3))

    path: str = ""                    # videos + Annotations/ or labels.csv; "": synthetic videos in the cache folder
    synthetic: bool = False               # generated data on purpose: needed under Slurm/submitit (data.path "")
    annotations: str = "auto"         # auto | upstream | csv (a labels.csv path may be given instead)
    merge: dict = field(default_factory=dict)   # upstream action merges, e.g. {paw_guard: paw_withdraw}
    require_all_classes: bool = False   # a class with no training case: refused (else named in a warning)
    cache: str = ""                   # frame cache folder ("": <path>/.frame-cache)
    size: int = 128                   # frames resized to size x size (0: as decoded)
    gray: bool = True
    clip_len: int = 17                # T, odd
    clip_stride: int = 1              # frames between the clip's frames
    sample_every: int = 1             # use every k-th labelled frame as a clip centre
    val_fraction: float = 0.2         # of the videos
    test_fraction: float = 0.2
    val_videos: list[str] = field(default_factory=list)     # explicit split (file names) instead of fractions
    test_videos: list[str] = field(default_factory=list)
    synthetic_videos: int = 8         # synthetic data (path empty)
    synthetic_frames: int = 90
    synthetic_classes: int = 4


@dataclass
class VideoModelConfig:
    """Architecture and memory options."""

    bounds: ClassVar[dict[str, Bound]] = dict(dropout=FRACTION)
    ignored: ClassVar[tuple[Ignored, ...]] = tuple(
        Ignored(key, example, lambda s: s.arch != "r3d_18", "model.arch=mouse3d or light (torchvision's r3d_18 "
                "has its own)", under=dict(arch="r3d_18"))
        for key, example in (("dropout", 0.2), ("grad_checkpoint", True), ("layout", "frames")))

    arch: Literal["mouse3d", "light", "r3d_18"] = "mouse3d"
    dropout: float = 0.5
    grad_checkpoint: bool = False     # recompute each block in the backward pass (less activation memory)
    # how mouse3d/light compute (the same weights, checkpoints and results): conv3d (Conv3d, MaxPool3d), or frames
    # (each 3D convolution as one 2D convolution over its three temporal taps stacked as channels, pooling in 2D)
    layout: Literal["conv3d", "frames"] = "conv3d"


@dataclass
class VideoLossConfig:
    """Cross-entropy over the classes."""

    bounds: ClassVar[dict[str, Bound]] = dict(label_smoothing=FRACTION)

    label_smoothing: float = 0.0

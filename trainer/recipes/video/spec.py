"""3D-CNN video behaviour classifier: what the trainer needs to know about this recipe (no torch imported here)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from trainer.config.spec import DataCommand, RecipeSpec, RecipeTools
from trainer.recipes.video.config import VideoDataConfig, VideoLossConfig, VideoModelConfig


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    d = VideoDataConfig()
    p.add_argument("--videos", type=int, default=d.synthetic_videos, help="number of .mp4 files")
    p.add_argument("--frames", type=int, default=d.synthetic_frames, help="frames per video")
    p.add_argument("--classes", type=int, default=d.synthetic_classes, help="motion classes (2-6)")


def _synth(args: argparse.Namespace) -> int:
    from trainer.recipes.video.data import synth_videos
    path = synth_videos(Path(args.out), args.videos, args.frames, classes=args.classes, seed=args.seed)
    print(f"wrote {args.videos} videos of {args.frames} frames and labels.csv to {path}")
    return 0


def _extract_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="folder of videos (searched recursively)")
    p.add_argument("--out", help="cache folder (default SRC/.frame-cache, where training looks)")
    p.add_argument("--size", type=int, default=128, help="frames resized to SIZE x SIZE (0: as decoded)")
    colour = p.add_mutually_exclusive_group()
    colour.add_argument("--gray", dest="gray", action="store_true", default=True, help="grayscale (default)")
    colour.add_argument("--rgb", dest="gray", action="store_false", help="RGB frames")


def _extract(args: argparse.Namespace) -> int:
    """Decode every video under --src into the frame cache (only what is missing or stale)."""
    from trainer.recipes.video import data as vd
    src = Path(args.src)
    videos = vd.find_videos(src)
    if not videos:
        print(f"no videos ({', '.join(vd.VIDEO_SUFFIXES)}) under {src}")
        return 2
    cache = Path(args.out) if args.out else src / ".frame-cache"
    manifest = vd.extract_frames(videos, cache, vd.CacheSpec(args.size, args.gray))
    frames = sum(manifest[name]["frames"] for name in videos)
    print(f"{len(videos)} videos, {frames} frames cached in {cache} (manifest.json)")
    return 0


def _bench_data(n: int, out: Path) -> list[str]:
    videos = 10                                    # 2 validate, 2 test (data.*_fraction 0.2): 6 train videos
    frames = max(60, math.ceil(n / 6 * 1.05))
    # the synthetic videos' size is part of the cache's name
    return [f"data.synthetic_videos={videos}", f"data.synthetic_frames={frames}",
            f"data.cache={out / 'data' / f'video-{videos}-{frames}'}"]


SPEC = RecipeSpec(
    name="video",
    recipe="trainer.recipes.video.recipe:VideoRecipe",
    summary="3D-CNN video behaviour classifier",
    data_config=VideoDataConfig, model_config=VideoModelConfig, loss_config=VideoLossConfig,
    renamed={"model.label_smoothing": "loss.label_smoothing"},
    defaults={"train.amp": "auto", "train.batch_size": 16, "train.epochs": 20, "optim.lr": 1e-3,
              "optim.weight_decay": 1e-2, "optim.warmup_epochs": 1.0, "optim.clip_grad_norm": 1.0,
              "train.num_workers": 2},
    tools=RecipeTools(
        synth=DataCommand("H.264 .mp4 files of moving squares and labels.csv", _synth_arguments, _synth),
        data_commands={"extract-frames": DataCommand("decode videos once into the uint8 frame cache training reads",
                                                     _extract_arguments, _extract)},
    ),
)


# the benchmark harness's preset (bench/run.py): per-rank batch, fixed overrides, and data(n, out) -> the
# overrides that give at least n training samples
BENCH = dict(batch=8, args=("model.arch=light", "data.size=64", "data.clip_len=9", "train.num_workers=1"),
             data=_bench_data)

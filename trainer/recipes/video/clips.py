"""Clips from the frame cache: a sample is T frames (odd) centred on a labelled frame, edge frames repeated,
labelled with the centre frame's class. Videos are split whole (no video in two splits).

    data = prepare(VideoDataConfig(path="data/videos"), seed=0)       # decodes once into the frame cache
    clip, label = data.splits["train"][0]                              # uint8 [C, T, H, W], int64
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.owners import exclusive
from trainer.recipes.video import data as D
from trainer.recipes.video.config import VideoDataConfig
from trainer.recipes.video.data import CacheSpec, DataError, Labels

log = logging.getLogger(__name__)


class Clips(torch.utils.data.Dataset):
    """(uint8 clip [C, T, H, W], label) for each (video, centre frame); memmaps opened lazily per worker."""

    def __init__(self, files: list[Path], lengths: list[int], video_idx: np.ndarray, centres: np.ndarray,
                 labels: np.ndarray, clip_len: int, stride: int):
        self.files, self.lengths = files, lengths
        self.video_idx, self.centres, self.labels = video_idx, centres, labels
        self.offsets = stride * (np.arange(clip_len) - clip_len // 2)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.labels)

    def frame_indices(self, i: int) -> np.ndarray:
        """Frame numbers of sample i's clip, clamped to the video (edge frames repeated)."""
        v = int(self.video_idx[i])
        return np.clip(self.centres[i] + self.offsets, 0, self.lengths[v] - 1)

    def __getitem__(self, i: int):
        v = int(self.video_idx[i])
        frames = self._maps.get(v)
        if frames is None:
            frames = self._maps[v] = np.load(self.files[v], mmap_mode="r")
        clip = np.asarray(frames[self.frame_indices(i)])                 # [T, H, W] or [T, H, W, 3]
        clip = clip[None] if clip.ndim == 3 else np.moveaxis(clip, -1, 0)
        return torch.from_numpy(np.ascontiguousarray(clip)), torch.tensor(int(self.labels[i]))

    def __getstate__(self):                   # DataLoader workers reopen the memmaps themselves
        return {**self.__dict__, "_maps": {}}

    @property
    def videos(self) -> set[int]:
        return set(self.video_idx.tolist())


@dataclass
class VideoData:
    splits: dict[str, Clips]
    class_names: list[str]
    videos: dict[str, list[str]]      # split -> video file names
    weights: torch.Tensor             # total / (C x count) over the training clips
    channels: int


def load_annotations(cfg: VideoDataConfig, root: Path) -> tuple[list[Labels], list[str]]:
    kind = cfg.annotations
    if kind not in ("auto", "upstream", "csv"):
        return D.read_generic(Path(kind))
    if kind == "upstream" or (kind == "auto" and (root / "Annotations").is_dir()):
        return D.read_upstream(root, dict(cfg.merge))
    if (root / "labels.csv").exists():
        if cfg.merge:
            raise DataError("data.merge applies to the upstream Annotations/ layout, not to labels.csv")
        return D.read_generic(root / "labels.csv")
    raise DataError(f"{root}: no annotations (expected Annotations/prediction_<video>.mp4_<trial>.csv or labels.csv)")


def split_videos(names: list[str], cfg: VideoDataConfig, seed: int) -> dict[str, list[str]]:
    """Whole videos per split: the explicit lists, else shuffled fractions (validation gets at least one)."""
    for split, chosen in (("val", cfg.val_videos), ("test", cfg.test_videos)):
        unknown = [v for v in chosen if v not in names]
        if unknown:
            raise DataError(f"data.{split}_videos: {unknown} not among the annotated videos {names}")
    if cfg.val_videos or cfg.test_videos:
        rest = [v for v in names if v not in cfg.val_videos and v not in cfg.test_videos]
        return {"train": rest, "val": list(cfg.val_videos), "test": list(cfg.test_videos)}
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    n_val = max(1, round(cfg.val_fraction * len(names))) if cfg.val_fraction > 0 else 0
    n_test = round(cfg.test_fraction * len(names))
    if n_val + n_test >= len(names):
        raise DataError(f"{len(names)} annotated video(s): too few for a training split plus {n_val} validation "
                        f"and {n_test} test video(s) (lower data.val_fraction / data.test_fraction)")
    return {"val": order[:n_val], "test": order[n_val:n_val + n_test], "train": order[n_val + n_test:]}


def class_weights(labels: np.ndarray, classes: int) -> torch.Tensor:
    """total / (C x count) per class (0 for a class with no training clip)."""
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    w = np.where(counts > 0, len(labels) / (classes * np.maximum(counts, 1)), 0.0)
    return torch.tensor(w, dtype=torch.float32)


def weights_table(names: list[str], labels: np.ndarray, weights: torch.Tensor) -> str:
    counts = np.bincount(labels, minlength=len(names))
    lines = ["Class Distribution and Weights", f"{'class':<16}{'clips':>8}{'share':>8}{'weight':>9}"]
    for name, c, w in zip(names, counts, weights.tolist()):
        lines.append(f"{name:<16}{c:>8}{c / max(len(labels), 1):>8.1%}{w:>9.3f}")
    return "\n".join(lines)


def prepare(cfg: VideoDataConfig, seed: int = 0, is_main: bool = True, share=lambda obj: obj) -> VideoData:
    """Annotations, the frame cache (rank 0 extracts what is missing or stale while the others wait in
    `share`, which hands them rank 0's outcome: an error there stops every rank at once), clips."""
    if cfg.clip_len < 1 or cfg.clip_len % 2 == 0:
        raise DataError(f"data.clip_len={cfg.clip_len}: the clip length must be odd (centred on its frame)")
    root = Path(cfg.path) if cfg.path else synthetic_root(cfg, seed)
    cache = Path(cfg.cache) if cfg.cache else root / ".frame-cache"
    spec = CacheSpec(cfg.size, cfg.gray)
    error, scanned = None, None
    if is_main:
        try:
            scanned = _extract(cfg, root, cache, spec, seed)
        except DataError as err:
            error = str(err)
    error = share(error)
    if error:
        raise DataError(error)
    annotated, names, found = scanned or _scan(cfg, root)
    manifest = D.read_manifest(cache)
    for a in annotated:
        reason = D.stale_reason(manifest.get(a.video), found[a.video], cache, spec, deep=False)   # rank 0 hashed
        if reason:
            raise DataError(f"{cache}: frames of {a.video}: {reason}; run `python -m trainer data extract-frames`")
        n = manifest[a.video]["frames"]
        if len(a.frames) and a.frames.max() >= n:
            raise DataError(f"annotations of {a.video}: frame {int(a.frames.max())} is beyond the video's "
                            f"{n} frames ({found[a.video]})")
    videos = split_videos([a.video for a in annotated], cfg, seed)
    by_name = {a.video: a for a in annotated}
    splits = {}
    for split, members in videos.items():
        if members:
            splits[split] = _clips([by_name[v] for v in members], manifest, cache, cfg)
    if "train" not in splits or len(splits["train"]) == 0:
        raise DataError(f"{root}: the training split has no labelled frames")
    weights = class_weights(splits["train"].labels, len(names))
    channels = 1 if cfg.gray else 3
    return VideoData(splits, names, videos, weights, channels)


def _scan(cfg: VideoDataConfig, root: Path) -> tuple[list[Labels], list[str], dict[str, Path]]:
    """(annotations, class names, video file name -> path); every annotated video must exist."""
    if not root.exists():
        raise DataError(f"data.path {root} does not exist")
    annotated, names = load_annotations(cfg, root)
    found = D.find_videos(root)
    missing = [a.video for a in annotated if a.video not in found]
    if missing:
        raise DataError(f"{root}: annotated video(s) {missing} not found (videos there: {sorted(found)})")
    return annotated, names, found


def synthetic_root(cfg: VideoDataConfig, seed: int) -> Path:
    """Where the synthetic videos live when data.path is empty: data.cache if set, else a folder named by what
    makes them, so that other data.synthetic_* settings or another seed never reuse these videos."""
    if cfg.cache:
        return Path(cfg.cache)
    return Path("runs/video-synth") / (f"{cfg.synthetic_videos}v-{cfg.synthetic_frames}f-{cfg.synthetic_classes}c-"
                                       f"seed{seed}")


def _extract(cfg: VideoDataConfig, root: Path, cache: Path, spec: CacheSpec, seed: int):
    """Rank 0: synthetic videos when data.path is empty, then the frame cache of every annotated video;
    returns _scan()'s result so rank 0 does not read the annotations twice."""
    if not cfg.path:
        made = dict(videos=cfg.synthetic_videos, frames=cfg.synthetic_frames, classes=cfg.synthetic_classes, seed=seed)
        record = root / "synthetic.json"
        if not record.exists():
            root.mkdir(parents=True, exist_ok=True)
            with exclusive(root / ".synth.lock", f"write the synthetic videos into {root}"):
                if not record.exists():            # (labels.csv, then the record: written last, once whole)
                    D.synth_videos(root, made["videos"], made["frames"], classes=made["classes"], seed=seed)
                    record.write_text(json.dumps(made) + "\n")
        if (before := json.loads(record.read_text())) != made:   # a named data.cache
            raise DataError(f"{root}: its synthetic videos were made with {before}, not {made} (data.synthetic_*, "
                            f"seed); give another data.cache, or remove {root}")
    annotated, names, found = _scan(cfg, root)
    D.extract_frames({a.video: found[a.video] for a in annotated}, cache, spec)
    return annotated, names, found


def _clips(items: list[Labels], manifest: dict, cache: Path, cfg: VideoDataConfig) -> Clips:
    files = [cache / manifest[a.video]["file"] for a in items]
    lengths = [int(manifest[a.video]["frames"]) for a in items]
    vid, centres, labels = [], [], []
    for v, a in enumerate(items):
        keep = slice(None, None, max(cfg.sample_every, 1))
        vid.append(np.full(len(a.frames[keep]), v))
        centres.append(a.frames[keep])
        labels.append(a.labels[keep])

    def cat(xs):
        return np.concatenate(xs).astype(np.int64)
    return Clips(files, lengths, cat(vid), cat(centres), cat(labels), cfg.clip_len, cfg.clip_stride)

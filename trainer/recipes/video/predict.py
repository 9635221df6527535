"""The video recipe's predictions (`trainer predict`): a label and the class probabilities of every frame of new
videos, first and last frames included, in the layout of the training labels (`video,frame,label`, then `time_s`
and `p_<class>`): the file can be reviewed, corrected and trained on as a labels.csv.

    python -m trainer predict --checkpoint runs/video --out labels.csv --data new_videos/     # or a .txt list, a file

Each frame is classified from the clip centred on it, as in training (data.clip_len frames, data.clip_stride
apart): near the ends of a video the window reaches past the first or last frame, and those positions repeat the
edge frame. Frames come through the frame cache at the checkpoint's data.size and data.gray (extracted once, by
rank 0, into <videos' folder>/.frame-cache; the others wait). time_s = frame / the container's frame rate.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from trainer.distributed import runtime
from trainer.engine.predict import PredictRequest
from trainer.engine.predict_parts import PredictError
from trainer.recipes.video import data as D
from trainer.recipes.video.clips import synthetic_root


def videos_of(path: Path) -> tuple[dict[str, Path], Path]:
    """(video file name -> path, the frame cache's folder) of a folder, a list file (one path per line) or a video."""
    if path.is_dir():
        found = D.find_videos(path)
        if not found:
            raise PredictError(f"--data {path}: no video there ({', '.join(sorted(D.VIDEO_SUFFIXES))})")
        return found, path / ".frame-cache"
    if path.suffix.lower() in D.VIDEO_SUFFIXES:
        return {path.name: path}, path.parent / ".frame-cache"
    listed = [Path(line.strip()) for line in path.read_text().splitlines() if line.strip()]
    missing = [str(p) for p in listed if not p.is_file()]
    if missing:
        raise PredictError(f"--data {path}: {len(missing)} listed videos not found ({', '.join(missing[:3])})")
    if not listed:
        raise PredictError(f"--data {path}: lists no video")
    return {p.name: p for p in listed}, listed[0].parent / ".frame-cache"


@dataclasses.dataclass
class Frames:
    """Every frame to label: the videos' cached frames and where each video starts in the unit numbering."""

    names: list[str]
    files: list[Path]
    counts: np.ndarray
    starts: np.ndarray
    fps: np.ndarray


def frames(recipe, request: PredictRequest) -> Frames:
    cfg = recipe.data_cfg
    root = Path(request.data) if request.data else Path(cfg.path) if cfg.path else synthetic_root(cfg, recipe.seed)
    videos, cache = videos_of(root)
    if not request.data and cfg.cache:
        cache = Path(cfg.cache)
    spec = D.CacheSpec(cfg.size, cfg.gray)
    error = None
    if recipe.dist.is_main:
        try:
            D.extract_frames(videos, cache, spec)
        except D.DataError as err:
            error = str(err)
    error = runtime.broadcast_object(error, recipe.dist)
    if error:
        raise PredictError(error)
    manifest = D.read_manifest(cache)
    names = sorted(videos)
    counts = np.array([manifest[n]["frames"] for n in names], dtype=np.int64)
    return Frames(names, [cache / manifest[n]["file"] for n in names], counts,
                  np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                  np.array([manifest[n].get("fps") or 0.0 for n in names], dtype=np.float64))


def units(recipe, request: PredictRequest) -> np.ndarray:
    recipe.predict_frames = f = frames(recipe, request)
    return np.arange(int(f.starts[-1]))


def rows(recipe, model, units: np.ndarray, request: PredictRequest) -> dict[str, np.ndarray]:
    f, cfg, names = recipe.predict_frames, recipe.data_cfg, recipe.class_names
    video = np.searchsorted(f.starts, units, side="right") - 1
    frame = units - f.starts[video]
    offsets = cfg.clip_stride * (np.arange(cfg.clip_len) - cfg.clip_len // 2)
    device = next(model.parameters()).device
    batch = recipe.train_cfg.eval_batch_size or recipe.train_cfg.batch_size
    maps = {}
    probs = []
    for start in range(0, len(units), batch):
        clips = []
        for v, centre in zip(video[start:start + batch], frame[start:start + batch]):
            if v not in maps:
                maps[v] = np.load(f.files[v], mmap_mode="r")
            clip = np.asarray(maps[v][np.clip(centre + offsets, 0, f.counts[v] - 1)])     # edge frames repeated
            clips.append(clip[None] if clip.ndim == 3 else np.moveaxis(clip, -1, 0))
        logits = recipe.logits(model, (torch.from_numpy(np.stack(clips)).to(device), None))
        probs.append(torch.softmax(logits.float(), 1).cpu().numpy())
    p = np.concatenate(probs) if probs else np.zeros((0, len(names)), np.float32)
    fps = f.fps[video]
    out = dict(video=np.asarray(f.names, dtype=object)[video], frame=frame,
               label=np.asarray(names, dtype=object)[p.argmax(1)],
               time_s=np.where(fps > 0, frame / np.where(fps > 0, fps, 1), np.nan).round(4))
    out.update({f"p_{name}": p[:, k] for k, name in enumerate(names)})
    return out

"""Video behaviour data: per-frame annotations, decoding (PyAV) into a uint8 frame cache, synthetic videos.

Annotations, either
- the upstream layout: `Annotations/prediction_<video>.mp4_<trial>.csv` with columns `Frame,Action`
  (action codes 0-7 = ACTIONS); the trials of a video are concatenated in trial order (a trial's frame
  0 follows the previous trial's last frame), or
- a generic `labels.csv` with columns `video,frame,label` (label: a class name or an integer).

    python -m trainer data extract-frames --src DIR --out DIR/frames --size 128 --gray
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.fingerprint import fingerprint
from trainer.data.owners import exclusive, private_name
from trainer.data.text import read_text
from trainer.native.extras import require

log = logging.getLogger(__name__)
ACTIONS = ("rest", "paw_withdraw", "paw_lick", "paw_guard", "paw_shake", "flinch", "walk", "active")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv")
UPSTREAM = re.compile(r"^prediction_(?P<video>.+?\.(?:mp4|avi))_(?P<trial>[^.]+)\.csv$")
CACHE_VERSION = 1


class DataError(ValueError):
    """Malformed input; the message names the file (and line and field where there is one)."""


@dataclass
class Labels:
    """The labelled frames of one video."""

    video: str                    # file name of the video, e.g. mouse1.mp4
    frames: np.ndarray            # int64 frame indices (ascending)
    labels: np.ndarray            # int64 class indices


# ------------------------------------------------------------------------------ annotations

def class_list(merge: dict[str, str]) -> list[str]:
    """ACTIONS without the ones merged into another, in code order."""
    for src, dst in merge.items():
        if src not in ACTIONS or dst not in ACTIONS:
            bad = src if src not in ACTIONS else dst
            raise DataError(f"data.merge: {bad!r} is not an action ({', '.join(ACTIONS)})")
        if dst in merge:
            raise DataError(f"data.merge: {src!r} -> {dst!r}, but {dst!r} is itself merged away")
    return [a for a in ACTIONS if a not in merge]


def read_upstream(folder: Path, merge: dict[str, str]) -> tuple[list[Labels], list[str]]:
    """Every `prediction_<video>_<trial>.csv` of folder/Annotations, trials concatenated per video."""
    names = class_list(merge)
    code_to_class = [names.index(merge.get(a, a)) for a in ACTIONS]
    trials: dict[str, list[tuple[str, Path]]] = {}
    for path in sorted((folder / "Annotations").glob("*.csv")):
        m = UPSTREAM.match(path.name)
        if m is None:
            raise DataError(f"{path}: not named prediction_<video>.mp4_<trial>.csv")
        trials.setdefault(m["video"], []).append((m["trial"], path))
    if not trials:
        raise DataError(f"{folder / 'Annotations'}: no prediction_*.csv files")
    out = []
    for video, parts in sorted(trials.items()):
        parts.sort(key=lambda tp: (0, int(tp[0]), "") if tp[0].isdigit() else (1, 0, tp[0]))
        frames, labels, offset = [], [], 0
        for _, path in parts:
            f, a = _read_columns(path, ("Frame", "Action"))
            for lineno, code in zip(range(2, len(a) + 2), a):
                if not 0 <= code < len(ACTIONS):
                    raise DataError(f"{path}:{lineno}: field 'Action': code {code} is not 0-{len(ACTIONS) - 1}")
            frames.append(f + offset)
            labels.append(np.asarray([code_to_class[c] for c in a], dtype=np.int64))
            offset += int(f.max()) + 1 if len(f) else 0
        out.append(_labels(video, np.concatenate(frames), np.concatenate(labels)))
    return out, names


def _read_columns(path: Path, columns: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """Integer columns of a CSV with a header (errors name file:line:field)."""
    with io.StringIO(read_text(path, DataError), newline="") as fh:   # BOM dropped, not-UTF-8 named
        rows = csv.reader(fh)
        header = [h.strip() for h in next(rows, [])]
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{path}:1: missing column(s) {', '.join(missing)} (header: {','.join(header)})")
        idx = [header.index(c) for c in columns]
        values: list[list[int]] = [[] for _ in columns]
        for lineno, row in enumerate(rows, 2):
            if not row or not "".join(row).strip():
                continue
            for k, (i, name) in enumerate(zip(idx, columns)):
                try:
                    values[k].append(int(row[i].strip()))
                except (ValueError, IndexError):
                    got = row[i] if i < len(row) else "nothing"
                    raise DataError(f"{path}:{lineno}: field '{name}': {got!r} is not an integer") from None
    return tuple(np.asarray(v, dtype=np.int64) for v in values)


def read_generic(path: Path, class_names: list[str] | None = None) -> tuple[list[Labels], list[str]]:
    """A `video,frame,label` CSV; labels are class names (or integers, then named by value)."""
    rows: dict[str, list[tuple[int, str, int]]] = {}
    with io.StringIO(read_text(path, DataError), newline="") as fh:   # BOM dropped, not-UTF-8 named
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        if header[:3] != ["video", "frame", "label"]:
            raise DataError(f"{path}:1: expected the header video,frame,label, got {','.join(header)!r}")
        for lineno, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) < 3:
                raise DataError(f"{path}:{lineno}: expected 3 fields video,frame,label, got {len(row)}")
            try:
                frame = int(row[1])
            except ValueError:
                raise DataError(f"{path}:{lineno}: field 'frame': {row[1]!r} is not an integer") from None
            if frame < 0:
                raise DataError(f"{path}:{lineno}: field 'frame': {frame} is negative")
            rows.setdefault(row[0].strip(), []).append((frame, row[2].strip(), lineno))
    if not rows:
        raise DataError(f"{path}: no labelled frames")
    seen = sorted({lab for r in rows.values() for _, lab, _ in r})
    if class_names is None:
        numeric = all(s.isdigit() for s in seen)
        class_names = [str(i) for i in range(max(map(int, seen)) + 1)] if numeric else seen
    out = []
    for video, items in sorted(rows.items()):
        labels = []
        for frame, lab, lineno in items:
            if lab not in class_names:
                raise DataError(f"{path}:{lineno}: field 'label': {lab!r} is not one of {', '.join(class_names)}")
            labels.append(class_names.index(lab))
        out.append(_labels(video, np.asarray([f for f, _, _ in items]), np.asarray(labels)))
    return out, list(class_names)


def _labels(video: str, frames: np.ndarray, labels: np.ndarray) -> Labels:
    order = np.argsort(frames, kind="stable")
    return Labels(video, frames[order].astype(np.int64), labels[order].astype(np.int64))


def find_videos(folder: Path) -> dict[str, Path]:
    """File name -> path of every video under folder (searched recursively, caches skipped)."""
    out: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in VIDEO_SUFFIXES and ".frame-cache" not in path.parts:
            out.setdefault(path.name, path)
    return out


# ------------------------------------------------------------------------------ decoding and the frame cache

def _open(path: Path):
    av = require("av", extra="video", purpose="the video recipe (decoding and writing videos)")
    try:
        container = av.open(str(path))
        if not container.streams.video:
            raise DataError(f"{path}: no video stream")
        return container
    except (av.error.FFmpegError, OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: unreadable or corrupt video ({type(err).__name__}: {err})") from None


def decode(path: Path, size: int = 0, gray: bool = True):
    """Yield the frames of a video as uint8 arrays [H, W] (gray) or [H, W, 3], resized to size x size
    when size > 0. Decoding errors name the file."""
    av = require("av", extra="video", purpose="the video recipe (decoding and writing videos)")
    container = _open(path)
    fmt = "gray" if gray else "rgb24"
    try:
        for frame in container.decode(video=0):
            if size:
                frame = frame.reformat(width=size, height=size, format=fmt)
            yield frame.to_ndarray(format=fmt)
    except av.error.FFmpegError as err:
        raise DataError(f"{path}: corrupt video, decoding failed ({type(err).__name__}: {err})") from None
    finally:
        container.close()


def video_info(path: Path) -> dict:
    """fps and frame size from the container header."""
    container = _open(path)
    try:
        s = container.streams.video[0]
        return dict(fps=float(s.average_rate or 0), width=s.codec_context.width, height=s.codec_context.height)
    finally:
        container.close()


@dataclass(frozen=True)
class CacheSpec:
    """How frames are stored: square size (0: as decoded) and gray or RGB."""

    size: int = 128
    gray: bool = True


FINGERPRINTS = ".fingerprints"     # in the cache: each video's hash under its path, size, mtime and inode


def cache_entry(video: Path, cache: Path, spec: CacheSpec) -> dict:
    """Decode video into cache/<name>.npy (uint8 [N, H, W(, 3)]) and return its manifest entry."""
    cache.mkdir(parents=True, exist_ok=True)
    raw = private_name(cache / f"{video.name}.raw")
    n, shape = 0, None
    with open(raw, "wb") as fh:
        for frame in decode(video, spec.size, spec.gray):
            if shape is None:
                shape = frame.shape
            fh.write(np.ascontiguousarray(frame).tobytes())
            n += 1
    if n == 0:
        raw.unlink()
        raise DataError(f"{video}: no frames could be decoded")
    target = cache / f"{video.name}.npy"
    tmp = private_name(target)
    src = np.memmap(raw, dtype=np.uint8, mode="r", shape=(n, *shape))
    dst = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(n, *shape))
    for start in range(0, n, 256):
        dst[start:start + 256] = src[start:start + 256]
    dst.flush()
    del src, dst
    os.replace(tmp, target)
    raw.unlink()
    info = video_info(video)
    return dict(file=target.name, frames=n, shape=list(shape), fps=info["fps"], source=str(video),
                source_size=video.stat().st_size, source_sha256=fingerprint(video, cache / FINGERPRINTS),
                size=spec.size, gray=spec.gray,
                version=CACHE_VERSION)


def read_manifest(cache: Path) -> dict:
    path = cache / "manifest.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err}); delete it to rebuild the cache") from None


def cached_shape(path: Path) -> tuple[int, ...] | None:
    """Shape of a cached .npy whose data is all there (None: truncated, garbage or unreadable)."""
    try:
        return tuple(np.load(path, mmap_mode="r").shape)
    except (ValueError, OSError, EOFError):   # numpy: "mmap length is greater than file size", bad header
        return None


def stale_reason(entry: dict | None, video: Path, cache: Path, spec: CacheSpec, deep: bool = True) -> str | None:
    """Why the cached frames of video cannot be used (None: they can); deep=False skips hashing the video
    (for checks right after extract_frames verified it)."""
    if entry is None:
        return "not cached"
    if entry.get("version") != CACHE_VERSION or entry.get("size") != spec.size or entry.get("gray") != spec.gray:
        return "cached with other settings"
    if not (cache / entry["file"]).exists():
        return "cache file missing"
    if cached_shape(cache / entry["file"]) != (entry["frames"], *entry["shape"]):
        return "cache file truncated or corrupt"
    if video.stat().st_size != entry["source_size"] or \
            (deep and fingerprint(video, cache / FINGERPRINTS) != entry["source_sha256"]):
        return "the video changed since it was cached"
    return None


def extract_frames(videos: dict[str, Path], cache: Path, spec: CacheSpec, progress: bool = True) -> dict:
    """Bring cache/ up to date for every video (stale or missing entries re-decoded); the manifest. Jobs sharing the
    folder take turns (cache/.extract.lock): the second finds the first's work done."""
    manifest = read_manifest(cache)
    reasons = {name: stale_reason(manifest.get(name), path, cache, spec) for name, path in videos.items()}
    if all(r is None for r in reasons.values()):
        return manifest
    cache.mkdir(parents=True, exist_ok=True)
    with exclusive(cache / ".extract.lock", f"extract the frames into {cache}"):
        manifest = read_manifest(cache)            # as the previous holder left it
        reasons = {name: stale_reason(manifest.get(name), path, cache, spec) for name, path in videos.items()}
        return _extract_locked(videos, reasons, manifest, cache, spec, progress)


def _extract_locked(videos: dict[str, Path], reasons: dict, manifest: dict, cache: Path, spec: CacheSpec,
                    progress: bool) -> dict:
    for partial in cache.glob(".*.tmp"):        # a killed extraction's (only the lock's holder writes here)
        partial.unlink(missing_ok=True)
    todo = {name: path for name, path in videos.items() if reasons[name] is not None}
    bar = None
    if progress and todo:
        from trainer.native.console import progress_bar
        bar = progress_bar(total=len(todo), desc="extract frames", unit="video")
    for name, path in todo.items():
        log.info("extracting %s (%s)", path, reasons[name])
        manifest[name] = cache_entry(path, cache, spec)
        _write_manifest(cache, manifest)      # after each video: an interrupted extraction keeps its work
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return manifest


def _write_manifest(cache: Path, manifest: dict) -> None:
    tmp = private_name(cache / "manifest.json")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, cache / "manifest.json")


# ------------------------------------------------------------------------------ synthetic videos

MOTIONS = ("still", "horizontal", "vertical", "circle", "pulse", "diagonal")


def synth_videos(out: Path, videos: int = 6, frames: int = 120, size: int = 64, classes: int = 4,
                 seed: int = 0, fps: int = 25) -> Path:
    """Real H.264 .mp4 files of a bright square on a noisy background whose motion is the class
    (MOTIONS[:classes]), in segments of 10-30 frames, and labels.csv (video,frame,label)."""
    av = require("av", extra="video", purpose="the video recipe (decoding and writing videos)")
    if not 2 <= classes <= len(MOTIONS):
        raise ValueError(f"classes must be 2..{len(MOTIONS)}")
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in range(videos):
        name = f"synth{v:02d}.mp4"
        container = av.open(str(out / name), "w")
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast"}
        labels = []
        while len(labels) < frames:
            labels += [int(rng.integers(classes))] * int(rng.integers(10, 31))
        labels = labels[:frames]
        cx, cy = rng.uniform(0.3, 0.7, 2) * size
        for t, label in enumerate(labels):
            img = _draw(MOTIONS[label], t, cx, cy, size, rng)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
            rows.append((name, t, MOTIONS[label]))
        for packet in stream.encode():
            container.mux(packet)
        container.close()
    with open(out / "labels.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["video", "frame", "label"])
        writer.writerows(rows)
    return out


def _draw(motion: str, t: int, cx: float, cy: float, size: int, rng) -> np.ndarray:
    amp, w = size * 0.22, 2 * np.pi * t / 8.0
    dx, dy = {"still": (0, 0), "horizontal": (amp * np.sin(w), 0), "vertical": (0, amp * np.sin(w)),
              "circle": (amp * np.cos(w), amp * np.sin(w)), "pulse": (0, 0),
              "diagonal": (amp * np.sin(w), amp * np.sin(w))}[motion]
    half = size * (0.1 + (0.06 * np.sin(w) if motion == "pulse" else 0))
    img = rng.integers(0, 40, size=(size, size, 3), dtype=np.uint8)
    x0, y0 = int(np.clip(cx + dx - half, 0, size - 1)), int(np.clip(cy + dy - half, 0, size - 1))
    x1, y1 = int(np.clip(cx + dx + half, 1, size)), int(np.clip(cy + dy + half, 1, size))
    img[y0:y1, x0:x1] = 220
    return img

"""From files to tensors: find the dataset's splits, carve a validation split (by subject where subjects are
known, else stratified by class), standardise every channel with training statistics only, and bring the
cases to one length (zero padding + per-case lengths for the mask, or linear resampling).

    data = load(HARDataConfig(path="../shared/data/BasicMotions"))
    data.splits["train"].x.shape   # [32, 6, 100]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data import cache
from trainer.recipes.har import data as D
from trainer.recipes.har.config import HARDataConfig
from trainer.recipes.har.data import DataError, Series

log = logging.getLogger(__name__)


@dataclass
class Windows(torch.utils.data.Dataset):
    """Fixed-length windows: x [N, C, L] float32, lengths [N] (valid prefix of each case), y [N]."""

    x: torch.Tensor
    lengths: torch.Tensor
    y: torch.Tensor
    subjects: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.lengths[i], self.y[i]


@dataclass
class HARData:
    """The prepared splits and what the model needs to know about them."""

    splits: dict[str, Windows]
    class_names: list[str]
    mean: np.ndarray                  # per-channel statistics of the training split
    std: np.ndarray
    source: str = "synthetic"

    @property
    def channels(self) -> int:
        return int(self.splits["train"].x.shape[1])

    @property
    def length(self) -> int:
        return int(self.splits["train"].x.shape[2])


# ------------------------------------------------------------------------------ finding the files

def read_splits(cfg: HARDataConfig) -> tuple[dict[str, Series], str]:
    """{'train': ..., 'test': ..., maybe 'val': ...} as stored, and a description of the source."""
    if not cfg.path:
        s = D.synthesize(cfg.synthetic_cases, cfg.synthetic_channels, cfg.synthetic_length, cfg.synthetic_classes)
        return _holdout(s, 0.25, "test", seed=1), "synthetic"
    path = Path(cfg.path)
    if not path.exists():
        raise DataError(f"data.path {path} does not exist")
    fmt = cfg.format if cfg.format != "auto" else _detect(path)
    if fmt == "uci-har":
        return {s: D.read_uci_har(path, s) for s in ("train", "test")}, f"UCI HAR ({D.uci_root(path)})"
    if fmt == "ts":
        return _ts_splits(path), f"UEA .ts ({path})"
    return _array_splits(path), f"arrays ({path})"


READER = 1                     # the text parse's version: part of the cache key


def _text_files(path: Path, fmt: str) -> list[Path]:
    """The files a UCI HAR or .ts dataset is read from (what its cache entry is keyed by)."""
    if fmt == "uci-har":
        root = D.uci_root(path)
        return sorted(f for f in root.rglob("*.txt") if f.parent.name in ("train", "test", "Inertial Signals")
                      or f.name == "activity_labels.txt")
    found = [path] if path.is_file() else sorted(path.glob("*_TRAIN.ts")) + sorted(path.glob("*_TEST.ts"))
    return [f for f in found if f.is_file()]


def build_flat(path: str, fmt: str) -> tuple[dict[str, np.ndarray], dict]:
    """The parsed-data cache's builder (trainer/data/cache.py): each split's flat Series as arrays, and meta."""
    splits, _ = read_splits(HARDataConfig(path=path, format=fmt, cache="off"))
    arrays, meta = {}, {}
    for name, s in splits.items():
        arrays.update({f"{name}_values": s.values, f"{name}_offsets": s.offsets, f"{name}_labels": s.labels})
        if s.subjects is not None:
            arrays[f"{name}_subjects"] = s.subjects
        meta[name] = dict(class_names=s.class_names, header=s.header)
    return arrays, meta


def read_splits_cached(cfg: HARDataConfig, local_rank: int = 0) -> tuple[dict[str, Series], str]:
    """read_splits, the text formats parsed once into the data cache (data.cache) and memory-mapped after."""
    root = cache.root_of(cfg.cache)
    path = Path(cfg.path) if cfg.path else None
    fmt = cfg.format if cfg.format != "auto" or path is None or not path.exists() else _detect(path)
    if root is None or path is None or fmt not in ("uci-har", "ts") or not path.exists():
        return read_splits(cfg)                                 # (its message names what is missing)
    path = path.resolve()
    files = _text_files(path, fmt)
    if not files or fmt == "ts" and path.is_dir() and len(list(path.glob("*_TRAIN.ts"))) != 1:
        return read_splits(cfg)                                 # (which says what is wrong)
    arrays, meta = cache.load_or_build_files(root, "har", path, files, dict(format=fmt, reader=READER),
                                             "trainer.recipes.har.prepare:build_flat", (str(path), fmt), local_rank,
                                             error=DataError, cap_gb=cfg.cache_cap_gb)
    splits = {name: Series(arrays[f"{name}_values"], arrays[f"{name}_offsets"], arrays[f"{name}_labels"],
                           m["class_names"], m["header"], arrays.get(f"{name}_subjects")) for name, m in meta.items()
              if f"{name}_values" in arrays}
    source = f"UCI HAR ({D.uci_root(path)})" if fmt == "uci-har" else f"UEA .ts ({path})"
    return splits, source


def _detect(path: Path) -> str:
    if path.is_file():
        return "ts" if path.suffix == ".ts" else "arrays"
    if D.uci_root(path) is not None:
        return "uci-har"
    if list(path.glob("*_TRAIN.ts")):
        return "ts"
    if list(path.glob("train.pt")) + list(path.glob("train.npz")):
        return "arrays"
    raise DataError(f"data.path {path}: no dataset found (expected 'UCI HAR Dataset/', NAME_TRAIN.ts + "
                    f"NAME_TEST.ts, or train.pt/train.npz [+ val, test])")


def _ts_splits(path: Path) -> dict[str, Series]:
    if path.is_file():
        return {"train": D.read_ts(path)}
    train = sorted(path.glob("*_TRAIN.ts"))
    if len(train) != 1:
        raise DataError(f"{path}: expected one NAME_TRAIN.ts, found {[p.name for p in train] or 'none'}")
    out = {"train": D.read_ts(train[0])}
    test = train[0].with_name(train[0].name.replace("_TRAIN.ts", "_TEST.ts"))
    if test.exists():
        out["test"] = D.read_ts(test)
        if out["test"].class_names != out["train"].class_names:
            raise DataError(f"{test}: @classLabel {out['test'].class_names} differs from {train[0].name}'s "
                            f"{out['train'].class_names}")
    return out


def _array_splits(path: Path) -> dict[str, Series]:
    if path.is_file():
        return {"train": D.read_arrays(path)}
    out = {}
    for split in ("train", "val", "test"):
        found = [p for p in (path / f"{split}.pt", path / f"{split}.npz") if p.exists()]
        if found:
            out[split] = D.read_arrays(found[0])
    if "train" not in out:
        raise DataError(f"{path}: no train.pt or train.npz")
    n = max(max(s.labels.max(initial=-1) for s in out.values()) + 1, 1)
    for s in out.values():                 # one class list for every split
        s.class_names = [str(i) for i in range(n)]
    return out


# ------------------------------------------------------------------------------ splitting

def _holdout(s: Series, fraction: float, name: str, seed: int, by: str = "auto") -> dict[str, Series]:
    """{'train': rest, name: held-out cases}: whole subjects when known (and by != stratified), else
    `fraction` of every class."""
    rng = np.random.default_rng(seed)
    labels = s.labels
    if by != "stratified" and s.subjects is not None and len(np.unique(s.subjects)) > 1:
        subjects = rng.permutation(np.unique(s.subjects))
        held, count = [], 0
        for subj in subjects[:-1]:                       # at least one subject stays in training
            if count >= fraction * len(labels):
                break
            held.append(subj)
            count += int((s.subjects == subj).sum())
        mask = np.isin(s.subjects, held)
    else:
        if by == "subject":
            raise DataError("data.val_split=subject, but the dataset records no subjects (or only one)")
        mask = np.zeros(len(labels), dtype=bool)
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            k = int(round(fraction * len(idx)))
            k = min(max(k, 1 if len(idx) > 1 else 0), len(idx) - 1)
            mask[idx[:k]] = True
    return {"train": subset(s, ~mask), name: subset(s, mask)}


def subset(s: Series, mask: np.ndarray) -> Series:
    """The cases of s where mask is true."""
    return s.take(np.flatnonzero(mask))


# ------------------------------------------------------------------------------ normalising

def channel_stats(s: Series) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation over every observed value (NaN = missing)."""
    values = s.values.astype(np.float64)                                          # [C, total length]
    mean = np.nanmean(values, axis=1)
    std = np.nanstd(values, axis=1)
    mean = np.where(np.isfinite(mean), mean, 0.0)
    std = np.where(np.isfinite(std) & (std > 1e-8), std, 1.0)
    return mean.astype(np.float32), std.astype(np.float32)


def _resample(x: np.ndarray, length: int) -> np.ndarray:
    """Linear interpolation of every channel to `length` points (missing values bridged)."""
    src = np.linspace(0.0, 1.0, x.shape[1])
    dst = np.linspace(0.0, 1.0, length)
    out = np.empty((x.shape[0], length), dtype=np.float32)
    for c, row in enumerate(x):
        ok = np.isfinite(row)
        out[c] = np.interp(dst, src[ok], row[ok]) if ok.any() else 0.0
    return out


def to_windows(s: Series, mean: np.ndarray, std: np.ndarray, length: int, mode: str) -> Windows:
    """Standardise with the given statistics, missing -> 0 (the training mean), then pad or resample."""
    n, c = len(s), s.channels
    values = (s.values - mean[:, None]) / std[:, None]
    if mode == "resample":
        x = np.zeros((n, c, length), dtype=np.float32)
        for i, case in enumerate(Series(values, s.offsets, s.labels, s.class_names).samples):
            x[i] = _resample(case, length)
        lengths = np.full(n, length, dtype=np.int64)
    else:                                        # pad/truncate: one scatter of every kept value
        lengths = np.minimum(s.lengths, length)
        case = np.repeat(np.arange(n), lengths)
        at = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)   # position in case
        x = np.zeros((n, length, c), dtype=np.float32)
        x[case, at] = np.nan_to_num(values[:, s.offsets[case] + at].T, nan=0.0)
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
    return Windows(torch.from_numpy(x), torch.from_numpy(lengths), torch.from_numpy(s.labels.copy()),
                   None if s.subjects is None else torch.from_numpy(s.subjects.copy()))


def load(cfg: HARDataConfig, seed: int = 0, local_rank: int = 0) -> HARData:
    """Read (parsed once into the data cache where the format is text), split, standardise and shape the dataset
    named by cfg."""
    raw, source = read_splits_cached(cfg, local_rank)
    if "val" not in raw and cfg.val_fraction > 0:
        raw.update(_holdout(raw["train"], cfg.val_fraction, "val", seed, cfg.val_split))
    train = raw["train"]
    if not len(train):
        raise DataError(f"{source}: the training split is empty")
    names = train.class_names
    for split, s in raw.items():
        if len(s) and s.channels != train.channels:
            raise DataError(f"{source}: the {split} split has {s.channels} channels, train has {train.channels}")
        if len(s.labels) and s.labels.max() >= len(names):
            raise DataError(f"{source}: the {split} split has class index {s.labels.max()} but there are "
                            f"{len(names)} classes")
    mean, std = channel_stats(train) if cfg.standardize else \
        (np.zeros(train.channels, np.float32), np.ones(train.channels, np.float32))
    longest = max(int(s.lengths.max()) for s in raw.values() if len(s))
    if cfg.length:
        length = cfg.length
    else:
        length = int(train.lengths.max()) if cfg.length_mode == "resample" else longest
    if cfg.length_mode == "pad" and length < longest:
        log.warning("data.length=%d is shorter than the longest case (%d): cases are truncated", length, longest)
    splits = {k: to_windows(s, mean, std, length, cfg.length_mode) for k, s in raw.items() if len(s)}
    return HARData(splits, names, mean, std, source)


def write_synthetic_uci(out: str | Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """Synthetic windows written in the UCI HAR layout; 9 of 30 subjects are the test set, as in UCI HAR."""
    rng = np.random.default_rng(seed)
    test_ids = np.arange(1, 31)[::3] + 1
    train_ids = np.setdiff1d(np.arange(1, 31), test_ids)
    ids = np.concatenate([rng.choice(train_ids, n_train), rng.choice(test_ids, n_test)])
    s = D.synthesize(n=n_train + n_test, seed=seed, subject_ids=ids)
    s.class_names = list(D.UCI_ACTIVITIES)
    is_test = np.arange(n_train + n_test) >= n_train
    root = Path(out) / "UCI HAR Dataset"
    for split, mask in (("train", ~is_test), ("test", is_test)):
        D.write_uci_har(root, split, subset(s, mask))
    return root

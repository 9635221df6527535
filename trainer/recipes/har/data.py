"""HAR data: readers of the multichannel time-series formats, and a synthetic generator.

UCI HAR: `UCI HAR Dataset/{train,test}/Inertial Signals/<signal>_<split>.txt` (one window of 128 values per
line, 9 signals), `y_<split>.txt` (activity 1-6), `subject_<split>.txt`, `activity_labels.txt`.
Arrays: `.npz` or `.pt` holding `samples` [N, C, T] and `labels` [N] (TS-TCC's train.pt/val.pt/test.pt),
optionally `subjects` [N].
UEA/sktime `.ts` files: `#` comments, `@directive value` header lines up to `@data`, then one case per
line: the dimensions separated by `:`, each a comma-separated series (`?` = missing, read as NaN), the
class label last when `@classLabel true`. Equal and unequal lengths are both read (into one flat array: Series).
"""
from __future__ import annotations

import io
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.data.flat import CLASS_FLOOR, check_dense
from trainer.data.text import finite, read_columns, read_text, text_lines

FLOAT32_MAX = float(np.finfo(np.float32).max)


class DataError(ValueError):
    """Malformed input; the message names the file, line and field."""


@dataclass
class Series:
    """Cases of a multichannel time-series file, flat: every case's values side by side in `values` (channels,
    total length; float32), case i in columns offsets[i]:offsets[i + 1] (one array for the whole split, not one
    per case: an equal-length split is a reshape away from its windows)."""

    values: np.ndarray                    # [channels, total length] float32
    offsets: np.ndarray                   # [cases + 1] int64
    labels: np.ndarray                    # int64 class indices into class_names
    class_names: list[str]
    header: dict[str, str] = field(default_factory=dict)
    subjects: np.ndarray | None = None    # int64 subject id per case, where the format records it

    @classmethod
    def of(cls, cases: list[np.ndarray], labels, class_names, header=None, subjects=None) -> Series:
        """From one (channels, length_i) array per case."""
        lengths = [c.shape[1] for c in cases]
        values = np.concatenate(cases, axis=1).astype(np.float32, copy=False) if cases else \
            np.zeros((0, 0), np.float32)
        return cls(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), labels, class_names,
                   header or {}, subjects)

    @classmethod
    def stacked(cls, x: np.ndarray, labels, class_names, header=None, subjects=None) -> Series:
        """From equal-length cases [N, C, T]."""
        n, c, t = x.shape
        return cls(np.ascontiguousarray(x.transpose(1, 0, 2).reshape(c, n * t), dtype=np.float32),
                   np.arange(n + 1, dtype=np.int64) * t, labels, class_names, header or {}, subjects)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def samples(self) -> list[np.ndarray]:
        """Each case's (channels, length) view (for small data and tests; the pipeline reads the flat arrays)."""
        return [self.values[:, a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    @property
    def channels(self) -> int:
        return int(self.values.shape[0]) if len(self) else 0

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, idx: np.ndarray) -> Series:
        """The cases at `idx`, in that order: one gather of their columns."""
        idx = np.asarray(idx, dtype=np.int64)
        lengths = self.lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        columns = np.repeat(self.offsets[idx] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Series(self.values[:, columns], offsets, self.labels[idx], self.class_names, self.header,
                      None if self.subjects is None else self.subjects[idx])


def _flag(header: dict[str, str], key: str, path: Path, default: bool) -> bool:
    value = header.get(key.lower())
    if value is None:
        return default
    word = value.split()[0].lower()
    if word not in ("true", "false"):
        raise DataError(f"{path}: @{key} must be true or false, got {value!r}")
    return word == "true"


def _series(text: str, path: Path, lineno: int, dim: int) -> np.ndarray:
    try:                                        # the numbers converted in C; a `?` or a bad token: one by one
        fast = np.array(text.split(","), dtype=np.float64)
        if np.isfinite(fast).all() and (np.abs(fast) <= FLOAT32_MAX).all():
            return fast.astype(np.float32)
    except ValueError:
        pass
    values = []
    for k, token in enumerate(text.split(","), 1):
        token = token.strip()
        if token == "?":
            values.append(math.nan)
            continue
        try:
            value = float(token)
        except ValueError:
            raise DataError(f"{path}:{lineno}: field 'dimension {dim} value {k}': {token!r} is not a number") from None
        values.append(finite(value, path, lineno, f"dimension {dim} value {k}", DataError, FLOAT32_MAX))
    return np.asarray(values, dtype=np.float32)


def read_ts(path: str | Path) -> Series:
    """Parse a `.ts` file (see the module docstring); errors name the file, line and field."""
    path = Path(path)
    header: dict[str, str] = {}
    samples: list[np.ndarray] = []
    labels: list[int] = []
    in_data = False
    for lineno, raw in text_lines(path, DataError):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            if not line.startswith("@"):
                raise DataError(f"{path}:{lineno}: expected a @directive or @data before the cases, "
                                f"got {line[:40]!r}")
            key, _, value = line[1:].partition(" ")
            if key.lower() == "data":
                in_data = True
                names, has_labels, dims = _layout(header, path)
            else:
                header[key.lower()] = value.strip()
            continue
        parts = line.split(":")
        if has_labels:
            label, parts = parts[-1].strip(), parts[:-1]
            if label not in names:
                raise DataError(f"{path}:{lineno}: field 'class label': {label!r} is not one of "
                                f"@classLabel {' '.join(names)}")
            labels.append(names.index(label))
        if dims is not None and len(parts) != dims:
            raise DataError(f"{path}:{lineno}: {len(parts)} dimensions, @dimensions says {dims}")
        series = [_series(text, path, lineno, d) for d, text in enumerate(parts, 1)]
        if len({len(s) for s in series}) != 1:
            raise DataError(f"{path}:{lineno}: the dimensions of one case differ in length "
                            f"({', '.join(str(len(s)) for s in series)})")
        samples.append(np.stack(series))
    if not in_data:
        raise DataError(f"{path}: no @data line")
    if not samples:
        raise DataError(f"{path}: no cases after @data")
    if len({s.shape[0] for s in samples}) != 1:
        raise DataError(f"{path}: cases have different numbers of dimensions")
    return Series.of(samples, np.asarray(labels, dtype=np.int64), names if has_labels else [], header)


def _layout(header: dict[str, str], path: Path) -> tuple[list[str], bool, int | None]:
    """(class names, whether cases end with a label, declared dimensions) from the header."""
    label_spec = header.get("classlabel", "false").split()
    has_labels = _flag(header, "classLabel", path, False)
    names = label_spec[1:] if has_labels else []
    if has_labels and not names:
        raise DataError(f"{path}: @classLabel true lists no class names")
    dims = header.get("dimensions")
    if dims is not None and not dims.isdigit():
        raise DataError(f"{path}: @dimensions {dims!r} is not an integer")
    return names, has_labels, int(dims) if dims is not None else None


# ------------------------------------------------------------------------------ UCI HAR

UCI_SIGNALS = tuple(f"{kind}_{axis}" for kind in ("body_acc", "body_gyro", "total_acc") for axis in "xyz")
UCI_ACTIVITIES = ("WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING")
UCI_WINDOW = 128


def uci_root(path: str | Path) -> Path | None:
    """The folder holding train/ and test/ of a UCI HAR copy (path itself or its 'UCI HAR Dataset')."""
    path = Path(path)
    for cand in (path, path / "UCI HAR Dataset"):
        if (cand / "train" / "y_train.txt").exists():
            return cand
    return None


def _matrix(path: Path, width: int) -> np.ndarray:
    """Whitespace-separated numbers, `width` per line, as an [lines, width] array."""
    try:
        text = read_text(path, DataError)                   # read once: the C parse, the count, the slow path
    except FileNotFoundError:
        raise DataError(f"{path}: missing") from None
    lines = text.splitlines()
    rows = read_columns(io.StringIO(text), np.float64)      # C speed; None where a row does not parse
    if rows is not None:
        rows = rows.reshape(len(rows), -1) if rows.ndim == 1 else rows
        if rows.shape == (len(lines), width) and np.isfinite(rows.astype(np.float32)).all():
            return rows
    for lineno, line in enumerate(lines, 1):   # slow path: find the first bad line
        tokens = line.split()
        if len(tokens) != width:
            raise DataError(f"{path}:{lineno}: {len(tokens)} values, expected {width}")
        for k, token in enumerate(tokens, 1):
            try:
                value = float(token)
            except ValueError:
                raise DataError(f"{path}:{lineno}: field 'value {k}': {token!r} is not a number") from None
            finite(value, path, lineno, f"value {k}", DataError, FLOAT32_MAX)
    raise DataError(f"{path}: blank lines between the rows")


def _ids(path: Path, what: str, low: int, high: int | None) -> np.ndarray:
    """One integer per line in [low, high]."""
    values = _matrix(path, 1)[:, 0]
    for lineno, v in enumerate(values, 1):
        if v != int(v) or v < low or (high is not None and v > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise DataError(f"{path}:{lineno}: field '{what}': {v:g} is not an integer in {bound}")
    return values.astype(np.int64)


def _activity_names(root: Path) -> list[str]:
    path = root / "activity_labels.txt"
    if not path.exists():
        return list(UCI_ACTIVITIES)
    names = []
    for lineno, line in text_lines(path, DataError):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or parts[0] != str(len(names) + 1):
            raise DataError(f"{path}:{lineno}: expected '{len(names) + 1} NAME', got {line!r}")
        names.append(parts[1])
    return names


def read_uci_har(path: str | Path, split: str) -> Series:
    """One split ('train' or 'test') of UCI HAR: 9 channels x 128 samples per window."""
    root = uci_root(path)
    if root is None:
        raise DataError(f"{path}: not a UCI HAR folder (no train/y_train.txt; expected 'UCI HAR Dataset/')")
    folder = root / split
    names = _activity_names(root)
    labels = _ids(folder / f"y_{split}.txt", "activity", 1, len(names)) - 1
    subjects = _ids(folder / f"subject_{split}.txt", "subject", 1, None)
    channels = []
    for signal in UCI_SIGNALS:
        f = folder / "Inertial Signals" / f"{signal}_{split}.txt"
        channels.append(_matrix(f, UCI_WINDOW).astype(np.float32))
    for f, n in [(folder / f"subject_{split}.txt", len(subjects))] + \
            [(folder / "Inertial Signals" / f"{s}_{split}.txt", len(c)) for s, c in zip(UCI_SIGNALS, channels)]:
        if n != len(labels):
            raise DataError(f"{f}: {n} lines, but y_{split}.txt has {len(labels)}")
    stacked = np.stack(channels, axis=1)                        # [N, 9, 128]
    return Series.stacked(stacked, labels, names, {"problemname": "UCI HAR"}, subjects)


def write_uci_har(root: str | Path, split: str, series: Series) -> Path:
    """Write a Series of 9 x 128 windows in the UCI HAR layout (for tests and synthetic data)."""
    folder = Path(root) / split
    (folder / "Inertial Signals").mkdir(parents=True, exist_ok=True)
    data = np.stack(series.samples)
    for c, signal in enumerate(UCI_SIGNALS):
        np.savetxt(folder / "Inertial Signals" / f"{signal}_{split}.txt", data[:, c], fmt="%.7e")
    np.savetxt(folder / f"y_{split}.txt", series.labels + 1, fmt="%d")
    subjects = series.subjects if series.subjects is not None else np.ones(len(series.labels), np.int64)
    np.savetxt(folder / f"subject_{split}.txt", subjects, fmt="%d")
    (Path(root) / "activity_labels.txt").write_text(
        "".join(f"{i} {n}\n" for i, n in enumerate(series.class_names, 1)))
    return Path(root)


# ------------------------------------------------------------------------------ arrays (.npz / .pt)

def read_arrays(path: str | Path, class_names: list[str] | None = None) -> Series:
    """`samples` [N, C, T] and `labels` [N] (and optional `subjects` [N]) from a .npz or .pt file."""
    path = Path(path)
    if path.suffix == ".npz":
        try:
            # the file opened here: np.load leaves its own open when the zip is damaged
            with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:   # truncated, garbage, pickled objects
            raise DataError(f"{path}: cannot be read as a .npz file ({type(err).__name__}: {err})") from None
    elif path.suffix == ".pt":
        import torch
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:   # truncated or not a tensor dict
            raise DataError(f"{path}: cannot be read as a tensor file ({type(err).__name__}: {err})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}: expected a dict with 'samples' and 'labels', got {type(obj).__name__}")
        arrays = {k: (v.numpy() if hasattr(v, "numpy") else np.asarray(v)) for k, v in obj.items()}
    else:
        raise DataError(f"{path}: unknown array format (use .npz or .pt)")
    for key in ("samples", "labels"):
        if key not in arrays:
            raise DataError(f"{path}: field {key!r} missing (found {', '.join(sorted(arrays)) or 'nothing'})")
    x, y = np.asarray(arrays["samples"], dtype=np.float32), np.asarray(arrays["labels"])
    if x.ndim != 3:
        raise DataError(f"{path}: field 'samples' has shape {tuple(x.shape)}, expected [N, C, T]")
    if not np.isfinite(x).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise DataError(f"{path}: field 'samples'{list(where)} = {x[where]!r} is not a finite number (NaN/inf "
                        f"makes every loss NaN); replace or drop the case")
    if y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: field 'labels' has shape {tuple(y.shape)}, expected [{len(x)}]")
    if y.size and (not np.all(np.equal(np.mod(y, 1), 0)) or y.min() < 0):
        bad = int(np.flatnonzero((np.mod(y, 1) != 0) | (y < 0))[0])
        raise DataError(f"{path}: field 'labels'[{bad}] = {y[bad].item()!r} is not a class index >= 0")
    y = y.astype(np.int64)
    subjects = arrays.get("subjects")
    if subjects is not None and np.asarray(subjects).shape != y.shape:
        raise DataError(f"{path}: field 'subjects' has shape {np.asarray(subjects).shape}, expected {y.shape}")
    n_classes = int(y.max()) + 1 if y.size else 0
    if y.size:
        check_dense("class", len(np.unique(y)), n_classes, n_classes - 1,
                    f"{path}: field 'labels'[{int(np.argmax(y))}]", DataError,
                    remap="relabel the classes 0..K-1 in the file", floor=CLASS_FLOOR)
    names = class_names or [str(i) for i in range(n_classes)]
    if y.size and n_classes > len(names):
        raise DataError(f"{path}: field 'labels' has class {n_classes - 1} but only {len(names)} class names")
    return Series.stacked(x, y, names, {"problemname": path.stem},
                  None if subjects is None else np.asarray(subjects).astype(np.int64))


# ------------------------------------------------------------------------------ synthetic

def synthesize(n: int = 600, channels: int = 9, length: int = 128, classes: int = 6, subjects: int = 10,
               seed: int = 0, noise: float = 0.6, subject_ids: np.ndarray | None = None) -> Series:
    """Windows whose class sets the frequency and amplitude pattern of every channel (learnable, not
    trivial: subject-specific gain and phase, Gaussian noise); subjects are recorded."""
    rng = np.random.default_rng(seed)
    t = np.arange(length, dtype=np.float64) / 50.0                # 50 Hz, like UCI HAR
    freq = 0.8 + 0.6 * rng.random((classes, channels)) * 4        # Hz per (class, channel)
    amp = 0.5 + rng.random((classes, channels))
    labels = np.arange(n) % classes
    rng.shuffle(labels)
    subject = rng.integers(1, subjects + 1, size=n) if subject_ids is None else np.asarray(subject_ids)
    subjects = int(subject.max())
    gain = 0.7 + 0.6 * rng.random((subjects + 1, channels))
    phase = rng.uniform(0, 2 * np.pi, size=(n, channels))
    x = amp[labels][:, :, None] * gain[subject][:, :, None] * \
        np.sin(2 * np.pi * freq[labels][:, :, None] * t + phase[:, :, None])
    x += noise * rng.normal(size=x.shape)
    names = [f"class{k}" for k in range(classes)]
    return Series.stacked(x.astype(np.float32), labels.astype(np.int64), names, {"problemname": "synthetic"},
                  subject.astype(np.int64))

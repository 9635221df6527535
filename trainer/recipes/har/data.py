"""HAR data: parsers for the multichannel time-series formats (issue 6; the recipe itself comes next).

UEA/sktime `.ts` files: `#` comments, `@directive value` header lines up to `@data`, then one case per
line: the dimensions separated by `:`, each a comma-separated series (`?` = missing, read as NaN), the
class label last when `@classLabel true`. Equal and unequal lengths are both read (one array per case).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """Malformed input; the message names the file, line and field."""


@dataclass
class Series:
    """Cases of a multichannel time-series file: samples[i] is (channels, length_i) float32."""

    samples: list[np.ndarray]
    labels: np.ndarray                    # int64 class indices into class_names
    class_names: list[str]
    header: dict[str, str] = field(default_factory=dict)

    @property
    def channels(self) -> int:
        return int(self.samples[0].shape[0]) if self.samples else 0

    @property
    def lengths(self) -> np.ndarray:
        return np.array([s.shape[1] for s in self.samples], dtype=np.int64)


def _flag(header: dict[str, str], key: str, path: Path, default: bool) -> bool:
    value = header.get(key.lower())
    if value is None:
        return default
    word = value.split()[0].lower()
    if word not in ("true", "false"):
        raise DataError(f"{path}: @{key} must be true or false, got {value!r}")
    return word == "true"


def _series(text: str, path: Path, lineno: int, dim: int) -> np.ndarray:
    values = []
    for k, token in enumerate(text.split(","), 1):
        token = token.strip()
        if token == "?":
            values.append(math.nan)
            continue
        try:
            values.append(float(token))
        except ValueError:
            raise DataError(f"{path}:{lineno}: field 'dimension {dim} value {k}': {token!r} is not a number") from None
    return np.asarray(values, dtype=np.float32)


def read_ts(path: str | Path) -> Series:
    """Parse a `.ts` file (see the module docstring); errors name the file, line and field."""
    path = Path(path)
    header: dict[str, str] = {}
    samples: list[np.ndarray] = []
    labels: list[int] = []
    in_data = False
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                if not line.startswith("@"):
                    raise DataError(f"{path}:{lineno}: expected a @directive or @data before the cases, got {line[:40]!r}")
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
    return Series(samples, np.asarray(labels, dtype=np.int64), names if has_labels else [], header)


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

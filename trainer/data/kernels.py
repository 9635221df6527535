"""The readers' work in C++ on every core (kernels.cpp): text parsed straight into flat columns, then the array steps
every reader takes next. Each function returns None where the extension is not available (or the input is not one
it takes): the caller's numpy path then does the same work, slower.

    cols = parse_columns("u.data", "iiFi")          # [user, item, time]; 'F': a finite number, not kept; None: refused
    cols = parse_columns("ratings.csv", "ii-i", ",", skip_lines=1)   # '-': a field read past
    cols = parse_columns("ratings.dat", "iiFi", "::")
    dense_codes(keys, hi)           # (codes 0..K-1 in the keys' order, K), keys in [0, hi]
    group_order(major, groups, minor)  # the stable order of the rows by (major code, minor)
    rescale_times(times, offsets)   # TiSASRec's per-user times
    tied_neighbours(a, b, order)    # whether order[j] and order[j + 1] share their (a, b)

Why: at 20M u.data rows here numpy's loadtxt took 3.5 s, a bare pandas.read_csv 1.6 s, this parser 1.2-1.6 s (it
reads the file in 32 MiB chunks, cuts each at line ends into one piece per thread and appends the pieces' columns
in order: contiguous columns, where loadtxt's are strided views of its rows, and the file is never held whole).
The array steps after it took 3.6 s in numpy (two np.unique-free lookups, a stable argsort, a per-user rescale in
six passes). The parser is only a fast path: where it refuses (another field count, a field not of its kind, a
quote), numpy's and then the line-by-line parsers read the file as before, and name the bad line.
TRAINER_DATA_KERNELS=0 turns the extension off.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainer.native import extensions as native

CHUNK_BYTES = 32 << 20
EXT = native.Extension("trainer_data_kernels", Path(__file__).with_name("kernels.cpp"), ["-O3", "-march=native",
                       "-fopenmp"], ["-fopenmp"], what="the C++ data kernels", fallback="numpy (2-3x slower)",
                       off_env="TRAINER_DATA_KERNELS")


def parse_columns(path: str | Path, kinds: str, delimiter: str = "", skip_lines: int = 0) -> list[np.ndarray] | None:
    """One array per 'i' (int64) or 'f' (float64) letter of `kinds` (one letter per field of each row; 'F' a
    finite number, checked and not kept; '-' read past), or None where the parser refuses the file or is not
    available."""
    ops = EXT.load()
    if ops is None:
        return None
    columns, _why = ops.parse_file(str(path), kinds, delimiter, skip_lines, CHUNK_BYTES)
    if not columns:
        return None
    return [c.numpy() for c in columns]


def _tensor(a: np.ndarray) -> torch.Tensor | None:
    """An int64 array as a tensor without a copy where it can be (None: not int64)."""
    if a.dtype != np.int64:
        return None
    return torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else np.array(a))


def dense_codes(keys: np.ndarray, hi: int) -> tuple[np.ndarray, int] | None:
    ops, t = EXT.load(), _tensor(keys)
    if ops is None or t is None:
        return None
    out, count = ops.dense_codes(t, int(hi))
    return out.numpy(), int(count)


def group_order(major: np.ndarray, groups: int, minor: np.ndarray) -> np.ndarray | None:
    ops, g, m = EXT.load(), _tensor(major), _tensor(minor)
    if ops is None or g is None or m is None:
        return None
    return ops.group_order(g, int(groups), m).numpy()


def rescale_times(times: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    ops, t, o = EXT.load(), _tensor(times), _tensor(offsets)
    if ops is None or t is None or o is None:
        return None
    return ops.rescale_times(t, o).numpy()


def tied_neighbours(a: np.ndarray, b: np.ndarray, order: np.ndarray) -> np.ndarray | None:
    ops, x, y, o = EXT.load(), _tensor(a), _tensor(b), _tensor(order)
    if ops is None or x is None or y is None or o is None:
        return None
    return ops.tied_neighbours(x, y, o).numpy()

"""Flat arrays with offsets, and the array operations every reader shares.

    rows = Ragged(flat, offsets)       # rows[u] is a view; len(rows), iteration, rows.lengths()
    codes(raw_ids) -> (codes 0..K-1 in the ids' order, K)
    stable_order(major, minor)         # rows by (major, minor), ties in their original order
    check_dense("entity", used, table, largest, "kg_final.txt:7", DataError)   # ids that size a table, bounded
"""
from __future__ import annotations

import numpy as np

from trainer.data import kernels


class Ragged:
    """Rows of one flat array cut at offsets: rows[u] is a view of flat[offsets[u]:offsets[u + 1]]."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def of(cls, rows) -> Ragged:
        rows = [np.asarray(r, dtype=np.int64) for r in rows]
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        return cls(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, u: int) -> np.ndarray:
        return self.flat[self.offsets[u]:self.offsets[u + 1]]

    def __iter__(self):
        return (self[u] for u in range(len(self)))

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getstate__(self) -> dict:
        """Memory-mapped arrays travel to loader workers as their file, not as a copy of their bytes."""
        return {name: (("map", arr.filename) if isinstance(arr, np.memmap) and arr.filename else ("array", arr))
                for name, arr in (("flat", self.flat), ("offsets", self.offsets))}

    def __setstate__(self, state: dict) -> None:
        for name, (how, value) in state.items():
            setattr(self, name, np.load(value, mmap_mode="r") if how == "map" else value)


def codes(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Contiguous codes 0..K-1 in order of the raw ids (numerically when they are all integers). Integer ids
    that are dense enough go through a lookup table (O(n)); others through np.unique (a sort)."""
    keys = np.asarray(raw)
    if keys.dtype.kind not in "iu":
        try:
            keys = keys.astype(np.int64)
        except (ValueError, OverflowError):
            pass
    if keys.dtype.kind in "iu" and len(keys):
        lo, hi = int(keys.min()), int(keys.max())
        if lo >= 0 and hi < 4 * len(keys) + (1 << 20):        # the table is at most a few times the ids
            done = kernels.dense_codes(keys, hi)
            if done is not None:
                return done
            present = np.zeros(hi + 1, dtype=bool)
            present[keys] = True
            table = np.cumsum(present, dtype=np.int64) - 1
            return table[keys], int(table[-1]) + 1
    uniq, inverse = np.unique(keys, return_inverse=True)
    return inverse.astype(np.int64).reshape(-1), len(uniq)


def stable_order(major: np.ndarray, minor: np.ndarray) -> np.ndarray:
    """The stable order of rows by (major, minor), major being codes >= 0: a counting sort in C++ (data kernels),
    else one sort of a combined int64 key where it fits (20x faster than np.lexsort here), else np.lexsort."""
    if not len(major):
        return np.zeros(0, dtype=np.int64)
    groups = int(major.max()) + 1
    if groups < 4 * len(major) + (1 << 20):                     # a counting sort's table is small
        done = kernels.group_order(major, groups, minor)
        if done is not None:
            return done
    lo, span = int(minor.min()), int(minor.max()) - int(minor.min()) + 1
    if groups * span < 2**63:
        return np.argsort(major * span + (minor - lo), kind="stable")
    return np.lexsort((minor, major))


# Ids that index a table directly (KGAT's user, item, entity and relation ids; class indices of array files): one
# stray large id would size the table by itself (one `0 7 999999` triple: 64M parameters, 8.9 GB, 13 s a step).
# A table of TABLE_FLOOR rows or more with more than MAX_UNUSED of its rows unused is refused before the model is
# built; smaller tables always pass (fixtures, small datasets).
TABLE_FLOOR = 10_000
CLASS_FLOOR = 100          # class indices: a classifier's output layer (labels 0, 1, 999: 1,000 outputs, 3 used)
MAX_UNUSED = 0.5


def check_dense(kind: str, used: int, table: int, largest: int, where: str, error: type[Exception],
                remap: str = "data.remap_ids=true", floor: int = TABLE_FLOOR) -> None:
    """Refuse a table sized by sparse ids: `used` of its `table` rows are used, `largest` is the id that sized
    it, found at `where` (file:line). `remap`: what compacts them; `floor`: the smallest table refused."""
    if table >= floor and used < (1 - MAX_UNUSED) * table:
        raise error(f"{where}: {kind} id {largest:,} makes the {kind} table {table:,} rows, of which {used:,} "
                    f"({100 * used / table:.2g}%) are used: ids of this format index the table directly, so the "
                    f"model would carry {table - used:,} rows no data touches (more than {MAX_UNUSED:.0%} unused "
                    f"in a table of {floor:,}+ rows is refused).\nHINT: correct the id, or "
                    + (f"set {remap} to compact the ids (the mapping is saved in the run directory and every "
                       f"checkpoint)" if remap.startswith("data.") else remap))

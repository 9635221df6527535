"""Predictions written in parts: each rank writes the parts it owns (part i: rank i % world) into OUT.parts/,
each part whole or not at all (a temporary renamed into place); rank 0 then joins them, in order, into OUT (CSV or
Parquet by its suffix, written the same way) or, for `--parts`, leaves the folder with its manifest. A requeued
predict finds the parts already written and computes only the others: nothing written twice or lost.

    parts = Parts(Path("top10.csv"), manifest={"checkpoint": ..., "units": 943, "part_size": 256})
    parts.open(overwrite=False)            # refuses an existing top10.csv; a folder of another prediction too
    for i in parts.todo(rank, world): parts.write(i, {"user": ..., "item": ...})
    parts.join()                           # rank 0, after a barrier
"""
from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


class PredictError(ValueError):
    """A prediction that cannot start or go on: one line for the user."""


def format_of(out: Path) -> str:
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise PredictError(f"--out {out}: unknown suffix {out.suffix!r}: name a .csv or .parquet file")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise PredictError(f"--out {out}: Parquet needs pyarrow (pip install 'hpc-trainer[parquet]'), or name "
                               f"a .csv file") from None
    return fmt


def check_out(out: Path, overwrite: bool) -> str:
    """--out before anything is loaded or submitted: a known suffix, and no file there unless overwrite."""
    fmt = format_of(out)
    if out.exists() and not overwrite:
        raise PredictError(f"--out {out} exists: pass --overwrite to replace it, or name another file")
    return fmt


def _replace_atomically(path: Path, write) -> None:
    """write(tmp) then rename over path: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_table(path: Path, columns: dict[str, np.ndarray], fmt: str) -> None:
    """One table file, atomically: CSV (a header, then the rows) or Parquet."""
    def write(tmp: Path) -> None:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({k: np.asarray(v) for k, v in columns.items()}), tmp)
            return
        with open(tmp, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(columns)
            out.writerows(zip(*(_text(v) for v in columns.values())))
    _replace_atomically(path, write)


def _text(values: np.ndarray) -> list:
    """Floats with every digit a float32 holds (repr), the rest as they are."""
    values = np.asarray(values)
    if values.dtype.kind == "f":
        return [repr(float(v)) for v in values.astype(np.float64)]
    return values.tolist()


class Parts:
    """OUT.parts/: part-00000.EXT ... and manifest.json (what was asked: a folder of another prediction is refused
    rather than mixed in)."""

    def __init__(self, out: Path, manifest: dict, count: int, keep_parts: bool = False):
        self.out, self.count, self.keep = Path(out), count, keep_parts
        self.fmt = format_of(self.out)
        self.folder = self.out.with_name(self.out.name + ".parts")
        self.manifest = dict(manifest, parts=count, format=self.fmt)

    def path(self, i: int) -> Path:
        return self.folder / f"part-{i:05d}.{'parquet' if self.fmt == 'parquet' else 'csv'}"

    def open(self, overwrite: bool, is_main: bool) -> int:
        """Rank 0: refuse an existing OUT (unless overwrite), start or check OUT.parts/; returns the parts already
        written (the others' ranks call it after a barrier, for the count)."""
        target = self.folder / "manifest.json"
        if is_main:
            check_out(self.out, overwrite)
            if self.folder.exists() and target.exists():
                old = json.loads(target.read_text())
                if old != self.manifest and not overwrite:
                    changed = sorted(k for k in set(old) | set(self.manifest) if old.get(k) != self.manifest.get(k))
                    raise PredictError(f"{self.folder} holds the parts of another prediction (it differs in "
                                       f"{', '.join(changed)}): pass --overwrite to start over, or remove it")
                if old != self.manifest:
                    shutil.rmtree(self.folder)
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob(".*.tmp"):          # a part a killed run was writing: not a part
                stale.unlink(missing_ok=True)
            if not target.exists():
                _replace_atomically(target, lambda tmp: tmp.write_text(json.dumps(self.manifest, indent=1) + "\n"))
        return self.done()

    def done(self) -> int:
        return sum(self.path(i).exists() for i in range(self.count))

    def todo(self, rank: int, world: int) -> list[int]:
        """The parts this rank owns that are not written yet."""
        return [i for i in range(rank, self.count, world) if not self.path(i).exists()]

    def write(self, i: int, columns: dict[str, np.ndarray]) -> None:
        write_table(self.path(i), columns, self.fmt)

    def join(self) -> Path:
        """Rank 0, once every part is written: OUT from the parts in order (the folder removed), or the folder
        itself with keep_parts."""
        missing = [i for i in range(self.count) if not self.path(i).exists()]
        if missing:
            raise PredictError(f"{self.folder}: parts {missing[:5]} are missing; run predict again to write them")
        if self.keep:
            return self.folder
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            tables = [pq.read_table(self.path(i)) for i in range(self.count)]
            _replace_atomically(self.out, lambda tmp: pq.write_table(pa.concat_tables(tables), tmp))
        else:
            def concat(tmp: Path) -> None:
                with open(tmp, "w", newline="") as f:
                    for i in range(self.count):
                        with open(self.path(i), newline="") as part:
                            header = part.readline()
                            if i == 0:
                                f.write(header)
                            shutil.copyfileobj(part, f)
            _replace_atomically(self.out, concat)
        shutil.rmtree(self.folder)
        return self.out

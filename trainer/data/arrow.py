"""Interactions from Parquet (a file or a folder of them) and Arrow IPC/Feather files, through pyarrow (the
`parquet` extra): only the user, item and time columns are read, straight into numpy arrays (SASRec's
interactions, KGAT's train/test pairs).

    users, items, times = read_table(Path("likes.parquet"), "parquet", pick, DataError)   # pick(header) -> indices

Parquet has no lines: a bad value is named by its file, column and row (0-based, in the file's order). Integer ids
must be >= 0 (as in u.data); text ids are names; a null in any read column is refused; timestamps of a timestamp
type are read as integers of their unit (only their order and gaps are used).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from trainer.native.extras import require


def _table(path: Path, kind: str, names: list[str] | None):
    """The column names (names None: the schema alone is read) or a table of the named columns."""
    pa = require("pyarrow", extra="parquet", purpose="reading Parquet and Arrow data (data.path)")
    if kind == "parquet":
        import pyarrow.parquet as pq
        if names is None:
            return (pq.ParquetDataset(path).schema if path.is_dir() else pq.read_schema(path)).names
        return pq.read_table(path, columns=names)
    import pyarrow.feather as feather
    if names is None:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).schema.names
    return feather.read_table(path, columns=names)


def _column(table, name: str, where: str, integer_ids: bool, error: type) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc
    col = table.column(name)
    if col.null_count:
        row = int(pc.index(pc.is_null(col), True).as_py())
        raise error(f"{where}: column '{name}': row {row} is null")
    if pa.types.is_timestamp(col.type) or pa.types.is_date(col.type):
        col = pc.cast(col, pa.int64())
    values = col.to_numpy()
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            row = int(np.argmax(bad))
            raise error(f"{where}: column '{name}': row {row}: {float(values[row])!r} is not "
                        f"{'an integer id' if integer_ids else 'a whole number'}")
        values = values.astype(np.int64)
    if values.dtype.kind in "iu":
        if integer_ids and (values < 0).any():
            row = int(np.argmax(values < 0))
            raise error(f"{where}: column '{name}': row {row}: {int(values[row])} is a negative id")
        return values.astype(np.int64, copy=False)
    return np.asarray(values, dtype=str)                     # ids that are names


def read_table(path: Path, kind: str, pick: Callable[[list[str]], tuple[int, int, int | None]],
               error: type) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(users, items, times or None) of a Parquet file or folder (kind "parquet") or an Arrow IPC/Feather file
    ("arrow"); `pick` names the indices of the user, item and time columns in the schema's names."""
    header = list(_table(path, kind, None))
    u, i, t = pick(header)
    names = [header[c] for c in (u, i, t) if c is not None]
    import pyarrow as pa
    # one column at a time: its Arrow chunks and its numpy copy are alive together, not the whole table's
    # (100M rows from Parquet peaked at 9.9 GB reading the three at once, 2.7 GB above the same rows from text)
    columns = []
    for k, name in enumerate(names):
        table = _table(path, kind, [name])
        columns.append(_column(table, name, str(path), k < 2, error))
        if k == 2 and columns[-1].dtype.kind not in "iu":
            raise error(f"{path}: column '{name}' holds {table.column(name).type}, not times (integers or a "
                        f"timestamp type)")
        del table
        pa.default_memory_pool().release_unused()        # back to the system before the next column
    return columns[0], columns[1], columns[2] if t is not None else None

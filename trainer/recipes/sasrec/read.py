"""Interactions files read at C speed into flat arrays; a row that does not parse is named by file, line and field.

    inter = read_interactions("ml-20m/ratings.csv")          # Interactions(user_ids, item_ids, times, ...)
    inter = read_interactions("u.data", duplicates="error")

Formats (auto-detected from the first line, or data.format):
  pairs  `user item` per line, already in time order (SASRec's ml-1m.txt)
  udata  `user item rating timestamp`, tab/space separated (MovieLens u.data, TiSASRec's ml-1m.txt)
  dat    `user::item::rating::timestamp` (MovieLens ratings.dat)
  csv    a header naming user and item columns (and optionally timestamp)
  parquet / arrow   a .parquet file or a folder of them, or an Arrow IPC/Feather file (.arrow, .feather): columns
         by name (pyarrow, the `parquet` extra); only the user, item and time columns are read
Column names (CSV, Parquet, Arrow): data.user_column, data.item_column, data.time_column, or the first of
USER_COLS, ITEM_COLS, TIME_COLS the header has (any case).

Each file is parsed once by numpy's C parser (trainer/data/text.py: read_columns) and checked with array
operations (negative ids, non-finite ratings, empty CSV ids). Where that refuses anything, the file is parsed
again line by line in Python, which names the first bad line and field (or accepts what the C parser does not:
a timestamp written `1.5e9`, udata lines of 3 and 4 fields mixed). Ids of the integer formats are int64; a CSV's
ids are names (`1.0` and `1` are two users) unless every one is an integer.
"""
from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data import kernels
from trainer.data.flat import codes, stable_order
from trainer.data.text import finite, line_numbers, read_columns, read_text, text_lines

log = logging.getLogger(__name__)
ARROW_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
FOLDER_FILES = ("u.data", "ratings.dat", "ratings.csv", "interactions.tsv", "interactions.csv", "ratings.tsv")
USER_COLS = ("user", "user_id", "userid", "uid")
ITEM_COLS = ("item", "item_id", "itemid", "movie_id", "movieid", "iid")
TIME_COLS = ("timestamp", "time", "ts", "datetime")


class DataError(ValueError):
    """Malformed input; the message names the file, line and field."""


@dataclass
class Interactions:
    """Parsed interactions as parallel flat arrays: raw ids (int64, or str where a file names them), times
    (None: the file's order is the time order). A row's file line is `lines[row]` where the line-by-line parser
    read it, else found in `source` on demand (line_of)."""

    user_ids: np.ndarray
    item_ids: np.ndarray
    times: np.ndarray | None
    lines: np.ndarray | None = None
    source: Path | None = None
    header_lines: int = 0

    def __post_init__(self):
        self.user_ids, self.item_ids = np.asarray(self.user_ids), np.asarray(self.item_ids)
        if self.lines is not None:
            self.lines = np.asarray(self.lines, dtype=np.int64)
        self._coded: tuple | None = None
        self._order: np.ndarray | None = None

    def coded(self) -> tuple[np.ndarray, int, np.ndarray, int]:
        """(user codes, users, item codes, items): contiguous codes in the order of the raw ids; made once."""
        if self._coded is None:
            self._coded = (*codes(self.user_ids), *codes(self.item_ids))
        return self._coded

    def chronological(self) -> np.ndarray:
        """The rows ordered by user, then time, then file order (the sequences' order); made once."""
        if self._order is None:
            times = self.times if self.times is not None else np.zeros(len(self), dtype=np.int64)
            self._order = stable_order(self.coded()[0], times)
        return self._order

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def users(self) -> list[str]:
        """The user ids as text (for small data and tests; the arrays are what the pipeline reads)."""
        return [str(u) for u in self.user_ids.tolist()]

    @property
    def items(self) -> list[str]:
        return [str(i) for i in self.item_ids.tolist()]

    def line_of(self, rows) -> np.ndarray | None:
        """The file line of each row (None where the rows were made, not read)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.lines is not None:
            return self.lines[rows]
        if self.source is not None:
            return line_numbers(self.source, rows, self.header_lines)
        return None

    def take(self, keep: np.ndarray) -> Interactions:
        """The rows where `keep` (a mask that keeps every user and item: dropped duplicates), with the codes and
        order already made carried over."""
        out = Interactions(self.user_ids[keep], self.item_ids[keep], None if self.times is None else self.times[keep],
                           None if self.lines is None else self.lines[keep])
        if self._coded is not None:
            u, n_users, i, n_items = self._coded
            out._coded = (u[keep], n_users, i[keep], n_items)
        if self._order is not None:
            new_index = np.cumsum(keep) - 1
            out._order = new_index[self._order[keep[self._order]]]
        return out


def detect(first: str, path: Path) -> str:
    if path.suffix == ".csv" or ("," in first and "::" not in first):
        return "csv"
    if "::" in first:
        return "dat"
    n = len(first.split())
    return {2: "pairs", 3: "udata", 4: "udata"}.get(n, "unknown")


def resolve_path(path: str | Path) -> Path:
    """A file, or the one interactions file inside a folder: one of FOLDER_FILES, else its only *.txt, else its
    .parquet files (a dataset). Two candidates (`interactions.csv` beside `ratings.parquet`) stop the run with both
    named: picking one would train on what the user may not have meant."""
    p = Path(path)
    if p.is_dir():
        known = [p / name for name in FOLDER_FILES if (p / name).is_file()]
        parquet = sorted(p.rglob("*.parquet"))
        if len(known) + bool(parquet) > 1:
            found = [f.name for f in known] + ([f"{len(parquet)} .parquet file(s)"] if parquet else [])
            raise DataError(f"{p}: more than one interactions file: {', '.join(found)}; set data.path to the one "
                            f"to read (e.g. data.path={known[0]})")
        if known:
            return known[0]
        txt = sorted(p.glob("*.txt"))
        if len(txt) == 1 and not parquet:
            return txt[0]
        if parquet:
            return p                                   # a Parquet dataset: every .parquet file under it
        more = f"; {len(txt)} *.txt files: set data.path to one" if txt else ""
        raise DataError(f"{p}: no interactions file found (looked for {', '.join(FOLDER_FILES)}, one *.txt or "
                        f".parquet files{more})")
    if not p.is_file():
        raise DataError(f"data.path {p} does not exist")
    return p


def data_files(path: Path) -> list[Path]:
    """The files a resolved data path stands for (a Parquet folder: its .parquet files, in order)."""
    return sorted(path.rglob("*.parquet")) if path.is_dir() else [path]


def read_interactions(path: str | Path, fmt: str = "auto", duplicates: str = "drop",
                      columns: tuple[str, str, str] = ("", "", "")) -> Interactions:
    """Parse an interactions file in one of the supported formats; repeated interactions (the same user, item
    and time) are dropped with a warning, kept, or refused (`duplicates`). `columns`: the user, item and time
    column names of a CSV, Parquet or Arrow file ("": found by their usual names)."""
    p = resolve_path(path)
    arrow = "parquet" if p.is_dir() else ARROW_SUFFIXES.get(p.suffix.lower())
    if fmt in ("parquet", "arrow") or fmt == "auto" and arrow:
        from trainer.data.arrow import read_table
        data = Interactions(*read_table(p, fmt if fmt != "auto" else arrow,
                                        lambda header: find_columns(header, columns, str(p)), DataError))
    else:
        data = _read_text(p, fmt, columns)
    if not len(data):
        raise DataError(f"{p}: no interactions")
    return without_duplicates(data, p, duplicates)


def _read_text(p: Path, fmt: str, columns: tuple[str, str, str]) -> Interactions:
    """A text format: at C speed, else line by line (which names the bad line)."""
    first = next((line for _, line in text_lines(p, DataError) if line.strip()), "")
    if not first:
        raise DataError(f"{p}: the file is empty")
    fmt = detect(first, p) if fmt == "auto" else fmt
    if fmt == "unknown":
        raise DataError(f"{p}:1: cannot tell the format from {first.strip()[:80]!r}; set data.format")
    return (_fast_csv(p, columns) if fmt == "csv" else _fast_delimited(p, fmt, first)) or \
        (_read_csv(p, columns) if fmt == "csv" else _read_delimited(p, fmt))


# ------------------------------------------------------------------------------ at C speed

def _fast_delimited(path: Path, fmt: str, first: str) -> Interactions | None:
    """pairs/udata/dat through the C parser, with the checks the line parser makes done on the arrays; None
    where either refuses (the line parser then names the line)."""
    fields = len(first.strip().split("::" if fmt == "dat" else None))
    if fmt == "pairs" and fields != 2 or fmt == "dat" and fields != 4 or fmt == "udata" and fields not in (3, 4):
        return None
    kinds = {"pairs": "ii", "dat": "iiFi"}.get(fmt, "iiFi" if fields == 4 else "iii")    # F: a finite rating
    parsed = kernels.parse_columns(path, kinds, "::" if fmt == "dat" else "")
    if parsed is not None:
        if (parsed[0] < 0).any() or (parsed[1] < 0).any():
            return None
        return Interactions(parsed[0], parsed[1], parsed[-1] if fmt != "pairs" else None, source=path)
    # no usecols: numpy's parser then also checks every row has the first row's field count; `dat`'s empty
    # fields between the colons are read as zero-length bytes
    if fmt == "dat":
        dtype = np.dtype([(n, t) for n, t in zip("uaibrct", ("i8", "S1", "i8", "S1", "i8", "S1", "i8"))])
        rows = read_columns(path, dtype, ":")
        if rows is None:                                       # ratings like 4.5
            rows = read_columns(path, np.dtype([*dtype.descr[:4], ("r", "f8"), *dtype.descr[5:]]), ":")
        if rows is None or (rows["a"] != b"").any() or (rows["b"] != b"").any() or (rows["c"] != b"").any():
            return None
        columns = [rows[n] for n in "uirt"]
    else:
        rows = read_columns(path, np.int64)                    # integer ratings: one pass, plain int64
        if rows is None and fields == 4:                       # ratings like 4.5
            rows = read_columns(path, np.dtype([("u", "i8"), ("i", "i8"), ("r", "f8"), ("t", "i8")]))
            columns = None if rows is None else [rows[n] for n in "uirt"]
        else:
            columns = None if rows is None else list(rows.T)
    if rows is None or not len(rows) or (columns[0] < 0).any() or (columns[1] < 0).any():
        return None
    if fields == 4 and not np.isfinite(columns[2]).all():
        return None
    # views into the parsed rows: copying three 20M-row columns out cost 1.2 s and 480 MB here
    return Interactions(columns[0], columns[1], columns[-1] if fmt != "pairs" else None, source=path)


def find_columns(header: list[str], columns: tuple[str, str, str], where: str) -> tuple[int, int, int | None]:
    """The indices of the user, item and (optional) time columns in a header: the configured names
    (data.user_column ...), else the first usual name present; any case."""
    lower = [h.strip().lower() for h in header]
    out = []
    for (names, required, key), given in zip(((USER_COLS, True, "user_column"), (ITEM_COLS, True, "item_column"),
                                               (TIME_COLS, False, "time_column")), columns):
        wanted = (given.lower(),) if given else names
        found = next((lower.index(n) for n in wanted if n in lower), None)
        if found is None and (required or given):
            raise DataError(f"{where}: header {lower} names no {given or names[0]} column "
                            f"({'data.' + key + '=' + given if given else 'accepted: ' + ', '.join(names)}; "
                            f"data.{key}=NAME names another)")
        out.append(found)
    return out[0], out[1], out[2]


def _csv_header(path: Path, columns: tuple[str, str, str]) -> tuple[list[str], int, int, int | None]:
    """The header's columns and the indices of the user, item and (optional) time columns."""
    first = next((line for _, line in text_lines(path, DataError)), "")
    header = [h.strip().lower() for h in next(csv.reader([first]), [])]
    return (header, *find_columns(header, columns, f"{path}:1"))


def _fast_csv(path: Path, columns: tuple[str, str, str]) -> Interactions | None:
    """At C speed: the ids and integer times together; times written as date-time text in a second pass."""
    header, u, i, t = _csv_header(path, columns)
    found = _fast_csv_columns(path, header, u, i, t)
    if found is not None or t is None:
        return found
    ids = _fast_csv_columns(path, header, u, i, None)
    text = read_columns(path, str, ",", usecols=(t,), skiprows=1, quotechar='"')
    seconds = datetime_seconds(text.reshape(-1)) if ids is not None and text is not None else None
    if seconds is None:
        return None                                    # the line-by-line parser names the bad line
    ids.times = seconds
    return ids


def _fast_csv_columns(path: Path, header: list[str], u: int, i: int, t: int | None) -> Interactions | None:
    cols = (u, i) + ((t,) if t is not None else ())
    kinds = "".join("i" if c in cols else "-" for c in range(len(header)))     # '-': a column read past
    parsed = kernels.parse_columns(path, kinds, ",", skip_lines=1)
    by_column = dict(zip(sorted(cols), parsed or ()))
    if parsed is not None and len(parsed[0]) and by_column[u].min() >= 0 and by_column[i].min() >= 0:
        return Interactions(by_column[u], by_column[i], by_column[t] if t is not None else None, source=path,
                            header_lines=1)              # else "-3" as a name: the ids are strings then
    numeric = np.dtype([(n, "i8") for n in ("u", "i", "t")[:len(cols)]])
    rows = read_columns(path, numeric, ",", usecols=cols, skiprows=1, quotechar='"')
    if rows is not None and len(rows) and ((rows["u"] < 0).any() or (rows["i"] < 0).any()):
        rows = None                                    # "-3" as a name: the ids are strings then
    if rows is None:                                   # ids that are names: read them as text
        ids = read_columns(path, str, ",", usecols=(u, i), skiprows=1, quotechar='"')
        times = read_columns(path, np.int64, ",", usecols=(t,), skiprows=1, quotechar='"') if t is not None else None
        if ids is None or (t is not None and times is None):
            return None
        ids = ids.reshape(-1, 2)
        users, items = np.char.strip(ids[:, 0]), np.char.strip(ids[:, 1])
        if (users == "").any() or (items == "").any():
            return None
        return Interactions(users, items, times.reshape(-1) if times is not None else None, source=path,
                            header_lines=1)
    return Interactions(rows["u"].copy(), rows["i"].copy(), rows["t"].copy() if t is not None else None,
                        source=path, header_lines=1)


# ------------------------------------------------------------------------------ line by line: naming the error

def _int(value: str, path: Path, line: int, field: str) -> int:
    try:
        return int(value)
    except ValueError:
        try:
            as_float = float(value)
        except ValueError:
            as_float = None
        if as_float is not None and as_float.is_integer():
            return int(as_float)
        raise DataError(f"{path}:{line}: field '{field}': {value!r} is not an integer") from None


TIME_FORMS = ("whole numbers (Unix seconds or any integer clock), ISO 8601 dates and date-times: 1997-09-22, "
              "1997-09-22 21:57:58, 1997-09-22T21:57:58.5Z, 1997-09-22T21:57:58+02:00")


def datetime_seconds(values: np.ndarray) -> np.ndarray | None:
    """Date-time text (ISO 8601; a space may stand for the T) as whole seconds since 1970 (UTC; an offset is applied,
    a time without one is taken as UTC; fractions of a second are dropped: ties keep the file's order), or None
    where a value is not one."""
    import warnings
    values = np.char.strip(np.asarray(values, dtype=str))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # numpy: "no explicit representation of timezones"
            stamps = values.astype("datetime64[s]")
    except ValueError:
        return None
    return None if np.isnat(stamps).any() else stamps.astype(np.int64)     # "" and "NaT" are not times


def _time(value: str, path: Path, line: int, field: str) -> int:
    """A time field: a whole number, else ISO 8601 date-time text (datetime_seconds), else a DataError naming the
    accepted forms and data.time_column."""
    try:
        return _int(value, path, line, field)
    except DataError:
        seconds = datetime_seconds(np.asarray([value]))
        if seconds is not None:
            return int(seconds[0])
    raise DataError(f"{path}:{line}: field '{field}': {value!r} is not a time; accepted: {TIME_FORMS}. Another "
                    f"column holds the times? data.time_column=NAME") from None


def _id(value: str, path: Path, line: int, field: str) -> int:
    """An id of a format whose ids are integers, written as one: `1.0` would become a second id beside `1`."""
    if value.isdigit() and value.isascii():
        return int(value)
    what = "a negative id" if value.startswith("-") and value[1:].isdigit() else "not an integer id"
    raise DataError(f"{path}:{line}: field '{field}': {value!r} is {what} (ids in this format are whole numbers "
                    f">= 0, written without a decimal point)")


def _read_delimited(path: Path, fmt: str) -> Interactions:
    users, items, times, lines = [], [], [], []
    sep = "::" if fmt == "dat" else None
    expected = {"pairs": (2, 2), "udata": (3, 4), "dat": (4, 4)}[fmt]
    for no, line in text_lines(path, DataError):
        if not line.strip():
            continue
        parts = line.strip().split(sep)
        if not expected[0] <= len(parts) <= expected[1]:
            raise DataError(f"{path}:{no}: expected {'-'.join(map(str, sorted(set(expected))))} fields "
                            f"({fmt} format), got {len(parts)}: {line.strip()[:80]!r}")
        users.append(_id(parts[0], path, no, "user"))
        items.append(_id(parts[1], path, no, "item"))
        lines.append(no)
        if fmt != "pairs":
            times.append(_time(parts[-1], path, no, "timestamp"))
            if len(parts) == 4:
                try:
                    rating = float(parts[2])
                except ValueError:
                    raise DataError(f"{path}:{no}: field 'rating': {parts[2]!r} is not a number") from None
                finite(rating, path, no, "rating", DataError)
    return Interactions(np.asarray(users, dtype=np.int64), np.asarray(items, dtype=np.int64),
                        np.asarray(times, dtype=np.int64) if fmt != "pairs" else None, lines)


def _read_csv(path: Path, columns: tuple[str, str, str]) -> Interactions:
    header, u, i, t = _csv_header(path, columns)
    with io.StringIO(read_text(path, DataError), newline="") as fh:
        reader = csv.reader(fh)
        next(reader, None)
        users, items, times, lines = [], [], [], []
        for no, row in enumerate(reader, 2):
            if not row or not any(c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise DataError(f"{path}:{no}: expected {len(header)} fields, got {len(row)}")
            for idx, name in ((u, "user"), (i, "item")):
                if not row[idx].strip():
                    raise DataError(f"{path}:{no}: field '{name}' is empty")
            users.append(row[u].strip())
            items.append(row[i].strip())
            lines.append(no)
            if t is not None:
                times.append(_time(row[t].strip(), path, no, header[t].strip() or "timestamp"))
    return Interactions(np.asarray(users, dtype=str), np.asarray(items, dtype=str),
                        np.asarray(times, dtype=np.int64) if t is not None else None, lines)


# ------------------------------------------------------------------------------ ids and duplicates, vectorized

def without_duplicates(data: Interactions, path: Path, policy: str) -> Interactions:
    """Rows repeating an earlier row's user, item and time (user and item where the file has no time): a
    double export, a concatenation run twice. They would count twice in the sequences and the targets.
    Found in the chronological order the sequences need anyway: only rows sharing a user and a time with
    another row can repeat one, and only those are compared by item."""
    if policy == "keep" or len(data) < 2:
        return data
    u, _, i, _ = data.coded()
    t = data.times if data.times is not None else np.zeros(len(u), dtype=np.int64)
    order = data.chronological()
    tied = kernels.tied_neighbours(u, t, order)         # the same user and time as the row before
    if tied is None:
        su, st = u[order], t[order]
        tied = (su[1:] == su[:-1]) & (st[1:] == st[:-1])
        del su, st
    if not tied.any():
        return data
    in_run = np.zeros(len(order), dtype=bool)
    in_run[1:] |= tied
    in_run[:-1] |= tied
    run = np.concatenate([[0], np.cumsum(~tied)])[in_run]       # which (user, time) run each candidate is in
    rows = order[in_run]
    by_item = stable_order(run, i[rows])                         # file order kept among equal items
    rows, run, item = rows[by_item], run[by_item], i[rows[by_item]]
    same = (run[1:] == run[:-1]) & (item[1:] == item[:-1])
    if not same.any():
        return data
    group = np.concatenate([[0], np.cumsum(~same)])
    first_of_group = rows[np.flatnonzero(np.concatenate([[True], ~same]))]
    repeats = np.flatnonzero(same) + 1                  # positions repeating an earlier row
    at = repeats[np.argmin(rows[repeats])]              # the repeat earliest in the file
    k, first = int(rows[at]), int(first_of_group[group[at]])
    lines = data.line_of([k, first])
    where = f"first at line {lines[0]} (repeating line {lines[1]})" if lines is not None else ""
    what = f"{path}: {len(repeats)} duplicate interaction(s) (the same user, item and time), {where}"
    if policy == "error":
        raise DataError(f"{what}.\nHINT: remove them, or set data.duplicates=drop (or keep).")
    log.warning("%s: dropped (data.duplicates=keep keeps them, =error refuses the file)", what)
    keep = np.ones(len(u), dtype=bool)
    keep[rows[repeats]] = False
    return data.take(keep)

"""The text of data files: UTF-8 with a byte-order mark dropped, and errors that name the file and line.

    for lineno, line in text_lines(path, DataError): ...      # line by line (Python): for locating an error
    text = read_text(path, DataError)
    rows = read_columns(path, np.dtype([("u", "i8"), ("i", "i8")]))   # at C speed; None where it refuses
    line_numbers(path, np.array([0, 41]))                   # the file lines of data rows 0 and 41

Readers parse with read_columns (numpy's C loadtxt: 2M u.data rows in 0.29 s here, a bare pandas.read_csv 0.15 s;
the line-by-line parser took 12.6 s) and, where it refuses or a vectorized check fails, parse again line by line,
which names the file, line and field. numpy is a dependency already; pandas and pyarrow are not (the GPU machine
has neither).
"""
from __future__ import annotations

import io
import math
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

BOM = b"\xef\xbb\xbf"


def _check_file(path: Path, error: type[Exception]) -> None:
    if path.is_dir():
        raise error(f"{path} is a directory; expected a data file (give the file inside it, or its folder as "
                    f"data.path)")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")


def _decode(raw: bytes, path: Path, lineno: int, error: type[Exception]) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}:{lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                    f"save the file as UTF-8") from None


def text_lines(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a leading BOM is dropped (spreadsheet exports write one)."""
    path = Path(path)
    _check_file(path, error)
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            yield lineno, _decode(raw, path, lineno, error)


def read_text(path: str | Path, error: type[Exception] = ValueError) -> str:
    """The whole file as text (see text_lines)."""
    path = Path(path)
    _check_file(path, error)
    data = path.read_bytes()
    if data.startswith(BOM):
        data = data[len(BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        raise error(f"{path}:{lineno}: not UTF-8 text (byte {data[err.start]:#04x}); save the file as "
                    f"UTF-8") from None


def finite(value: float, path: Path, lineno: int, field: str, error: type[Exception], dtype_max: float = math.inf):
    """value, or an error naming file:line and field when it is NaN, infinite, or beyond float32 (inf once
    stored)."""
    if not math.isfinite(value) or abs(value) > dtype_max:
        raise error(f"{path}:{lineno}: field '{field}': {value!r} is not a finite number"
                    + (f" in float32 (|x| <= {dtype_max:.3g})" if math.isfinite(value) else "")
                    + "; a NaN/inf in the data makes every loss NaN or silently ruins the statistics")
    return value


def read_columns(path: str | Path | io.TextIOBase, dtype, delimiter: str | None = None, usecols=None,
                 skiprows: int = 0, quotechar: str | None = None) -> np.ndarray | None:
    """The rows of a delimited text file (or of text already read: a text stream) as one array (a structured
    dtype: one field per column), parsed in C; a BOM dropped, blank lines skipped, no comment character. None
    where a row does not parse (a wrong field count, a value that is not of its column's type, text that is not
    UTF-8): the caller's line-by-line parser then finds and names it."""
    try:
        opened = path if isinstance(path, io.TextIOBase) else open(path, encoding="utf-8-sig")
        with opened as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore")             # "input contained no data": the caller says so
            return np.loadtxt(fh, dtype=dtype, delimiter=delimiter, usecols=usecols, skiprows=skiprows,
                              comments=None, quotechar=quotechar, ndmin=1)
    except (ValueError, UnicodeDecodeError):
        return None


_SPACE = np.array([9, 10, 11, 12, 13, 32], dtype=np.uint8)


def line_numbers(path: str | Path, rows: np.ndarray, skip: int = 0, chunk: int = 1 << 24) -> np.ndarray:
    """The 1-based file line of each data row in `rows` (0-based, counting the non-blank lines after the first
    `skip` lines, as read_columns counts them), found by one pass over the bytes in chunks: for messages."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.full(len(rows), -1, dtype=np.int64)
    seen, lines_before, carry_blank = 0, 0, True       # data rows and lines of earlier chunks
    with open(path, "rb") as fh:
        while (out < 0).any():
            raw = fh.read(chunk)
            if not raw:
                break
            b = np.frombuffer(raw, dtype=np.uint8)
            newline = b == 10
            line_of = np.cumsum(newline) - newline            # line index (in this chunk) of every byte
            full = np.flatnonzero(~np.isin(b, _SPACE))
            nonblank = np.unique(line_of[full])
            if len(nonblank) and nonblank[0] == 0 and not carry_blank:
                nonblank = nonblank[1:]                        # that line began in the previous chunk
            absolute = nonblank + lines_before + 1
            absolute = absolute[absolute > skip]
            want = (rows >= seen) & (rows < seen + len(absolute)) & (out < 0)
            out[want] = absolute[rows[want] - seen]
            seen += len(absolute)
            last_line = int(newline.sum())             # the line still open at the chunk's end (maybe empty)
            open_has_text = bool(len(full)) and line_of[full[-1]] == last_line
            carry_blank = not open_has_text and (last_line > 0 or carry_blank)
            lines_before += last_line
    return out


_POW10 = 10 ** np.arange(19, dtype=np.int64)
_ALLOWED = np.zeros(256, dtype=bool)
_ALLOWED[[9, 10, 13, 32]] = True
_ALLOWED[48:58] = True


def read_int_rows(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A file of whitespace-separated whole numbers >= 0 in lines of any length (KGAT's `user item item ...`),
    parsed with array operations: (values, offsets of each non-blank line's values, each such line's number).
    None where anything else is in it (a sign, a point, a letter, a byte that is not ASCII, a number of more than
    18 digits, no number at all): the caller's line-by-line parser then names the line and field."""
    raw = Path(path).read_bytes()
    b = np.frombuffer(raw, dtype=np.uint8)[len(BOM) if raw.startswith(BOM) else 0:]
    if not len(b) or not _ALLOWED[b].all():
        return None
    digit = (b >= 48) & (b <= 57)
    edge = np.diff(np.concatenate([[False], digit, [False]]).astype(np.int8))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)   # each number's [start, end)
    if not len(starts) or (ends - starts).max() > 18:
        return None
    at = np.flatnonzero(digit)
    token = np.repeat(np.arange(len(starts)), ends - starts)
    place = _POW10[ends[token] - at - 1]
    first_digit = np.concatenate([[0], np.cumsum(ends - starts)[:-1]])
    values = np.add.reduceat((b[at] - 48).astype(np.int64) * place, first_digit)
    line = np.cumsum(b == 10)[starts] + 1                       # the line of each number
    first = np.flatnonzero(np.concatenate([[True], line[1:] != line[:-1]]))
    offsets = np.concatenate([first, [len(values)]]).astype(np.int64)
    return values, offsets, line[first]

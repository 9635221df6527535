"""The text of data files: UTF-8 with a byte-order mark dropped, and errors that name the file and line.

    for lineno, line in text_lines(path, DataError): ...
    text = read_text(path, DataError)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

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

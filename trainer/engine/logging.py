"""Run logging: console + train.log, metrics.jsonl and TensorBoard on rank 0; warnings from every rank."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from trainer.distributed.runtime import DistInfo
from trainer.engine.write_failures import RunLogHandler, WriteFailures
from trainer.launch.exitcodes import disk_error

FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class ConsoleHandler(logging.StreamHandler):
    """stderr; while a tqdm progress bar is shown, a line goes through tqdm.write, which clears the bar, prints
    the line and draws the bar again below it: bars and log lines never share a line."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm_module = sys.modules.get("tqdm")
        if tqdm_module is None or not getattr(tqdm_module.tqdm, "_instances", None):
            super().emit(record)
            return
        try:
            tqdm_module.tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


def setup_logging(info: DistInfo, run_dir: str | Path | None = None, level: int = logging.INFO,
                  per_rank: bool = False) -> None:
    """Rank 0 logs INFO to the console and run_dir/train.log; other ranks log warnings only. per_rank
    (log.per_rank): every rank also writes its INFO lines to run_dir/train.rank{N}.log."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_trainer", False):
            root.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = [ConsoleHandler(sys.stderr)]
    handlers[0].setLevel(level if info.is_main else logging.WARNING)
    if run_dir is not None and info.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(RunLogHandler(Path(run_dir) / "train.log"))
        handlers[-1].setLevel(level)
    if run_dir is not None and per_rank:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(RunLogHandler(Path(run_dir) / f"train.rank{info.rank}.log"))
        handlers[-1].setLevel(level)
    for handler in handlers:
        handler._trainer = True
        handler.addFilter(_RankFilter(info.rank))
        handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)


class HeldRecords(logging.Handler):
    """Log records held until the run directory may be written (a refusal writes nothing there), then replayed
    into train.log by attach_run_log; the console shows them at once."""

    def __init__(self, limit: int = 20000):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.limit = limit

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.limit:
            self.records.append(record)


def hold_logging(info: DistInfo, level: int = logging.INFO) -> HeldRecords:
    """The console at once; the run directory's logs later (attach_run_log), with what was logged until then."""
    setup_logging(info, None, level)
    held = HeldRecords()
    held._trainer = True
    held.addFilter(_RankFilter(info.rank))
    logging.getLogger().addHandler(held)
    return held


def attach_run_log(info: DistInfo, run_dir: str | Path, held: HeldRecords | None, per_rank: bool = False,
                   level: int = logging.INFO) -> None:
    """setup_logging with run_dir's files, which begin with the records held since the start."""
    setup_logging(info, run_dir, level, per_rank)
    files = [h for h in logging.getLogger().handlers
             if getattr(h, "_trainer", False) and isinstance(h, logging.FileHandler)]
    for record in held.records if held is not None else ():
        for handler in files:
            if record.levelno >= handler.level:
                handler.handle(record)


def _plain(value: Any) -> Any:
    """JSON-safe value (tensors and numpy scalars to Python numbers, NaN to None)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class MetricsWriter:
    """metrics.jsonl (one object per line: split, epoch, step, metrics), TensorBoard scalars and images.
    purge_step: a resumed run's step; TensorBoard drops what an earlier attempt logged from that step on, so
    the steps replayed after the checkpoint are not shown twice."""

    def __init__(self, run_dir: str | Path, info: DistInfo, tensorboard: bool = True, purge_step: int | None = None,
                 failures: WriteFailures | None = None):
        self.enabled = info.is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.failures = failures        # a failed write is noted there (every rank stops at the next agreement)
        self.redone_to = -1             # a resumed run's train steps up to this one were logged before: marked
        self.listeners: list[Callable[[dict[str, Any]], None]] = []     # each record, once written (the components')
        if self.enabled and purge_step is not None:
            self.redone_to = repair_metrics(self.path)
        self.tb = None
        if self.enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge_step)
            except ImportError as err:  # tensorboard is an optional dependency
                logging.getLogger(__name__).warning("TensorBoard disabled: %s", err)

    def write(self, split: str, epoch: int, step: int, metrics: dict[str, Any]) -> None:
        """Append one record and mirror its scalars to TensorBoard as <split>/<name>."""
        if not self.enabled:
            return
        record = dict(split=split, epoch=epoch, step=step, time=round(time.time(), 3), **_plain(metrics))
        if split == "train" and step <= self.redone_to:
            record["redone"] = True     # logged before the resume too: the run went back to its checkpoint
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as err:
            self._failed(self.path, err, "metrics")
            return
        for listener in self.listeners:
            listener(record)
        if self.tb is not None:
            try:
                for name, value in metrics.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        self.tb.add_scalar(f"{split}/{name}", value, step)
                self.tb.flush()
            except OSError as err:
                self._failed(self.tb.log_dir, err, "TensorBoard events")

    def _failed(self, path: str | Path, err: OSError, what: str) -> None:
        """No more records after a failed write (a later one could land after a cut-off line); noted, or raised."""
        self.enabled = False
        if self.failures is None:
            raise disk_error(path, err, what) from None
        self.failures.note(path, err, what)

    def image(self, tag: str, png: str | Path, step: int) -> None:
        """A PNG written by a recipe (e.g. a confusion matrix), also as a TensorBoard image."""
        if self.tb is None or not Path(png).exists():
            return
        import numpy as np
        from PIL import Image
        with Image.open(png) as img:
            self.tb.add_image(tag, np.asarray(img.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def repair_metrics(path: Path) -> int:
    """Before a resumed run appends: a last record cut off by a failed write (no newline) is moved to
    metrics.jsonl.damaged, so the next record starts a line of its own. Returns the last train step logged."""
    try:
        data = path.read_bytes()
    except OSError:
        return -1
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path.with_name(path.name + ".damaged"), "ab") as fh:
            fh.write(data[keep:] + b"\n")
        with open(path, "r+b") as fh:
            fh.truncate(keep)
        logging.getLogger(__name__).warning("%s: its last record was cut off (%d bytes, a failed write); kept in %s",
                                            path, len(data) - keep, path.name + ".damaged")
        data = data[:keep]
    steps = [r["step"] for r in read_lines(data.decode(errors="replace"), path)[0] if r.get("split") == "train"]
    return max(steps, default=-1)


def read_lines(text: str, path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(the records, "FILE:LINE: what is wrong" for each line that is not one)."""
    rows, damaged = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            damaged.append(f"{path}:{number}: not a JSON record ({err})")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            damaged.append(f"{path}:{number}: not a JSON object")
    return rows, damaged


def read_metrics(run_dir: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """Records of run_dir/metrics.jsonl (optionally one split), for tests and tools; a damaged line is skipped with
    a warning naming its file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows, damaged = read_lines(path.read_text(errors="replace"), path)
    for line in damaged:
        logging.getLogger(__name__).warning("%s: skipped", line)
    return [r for r in rows if split is None or r.get("split") == split]

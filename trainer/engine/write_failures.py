"""A write that failed mid-run (metrics.jsonl, train.log, TensorBoard; a rank's own log) stops every rank alike: the
failing rank notes it where it happens instead of raising alone (logging would swallow it; rank 0 raising alone
left the others waiting in a collective until the agent killed them), and the ranks agree on it at the next logging
window, checkpoint, and at the end: each then raises the same DiskError, exit 4 (trainer/engine/exits.py).

    failures = WriteFailures()
    failures.note(path, err, "metrics")      # where the write failed (the first one is kept)
    failures.agree(info)                     # a collective: every rank raises the first failure, if any
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.launch.exitcodes import DiskError, disk_error


class WriteFailures:
    """The first write this process failed, as the one-line message every rank stops with."""

    def __init__(self):
        self.first: str | None = None

    def note(self, path: str | Path, err: BaseException, what: str) -> None:
        if self.first is None:
            self.first = str(disk_error(path, err, what, "free space on that file system, then resume with "
                                                         "--resume auto (the last checkpoint is kept)"))

    def flag(self) -> float:
        """1.0 once a write failed here: summed in the logging window's collective."""
        return 1.0 if self.first is not None else 0.0

    def agree(self, info: DistInfo) -> None:
        """Every rank raises the first failure any rank noted (a collective: every rank calls it together)."""
        found = [m for m in runtime.all_gather_object(self.first, info) if m] if info.distributed else \
            [self.first] if self.first else []
        if found:
            raise DiskError(found[0])


class RunLogHandler(logging.FileHandler):
    """train.log (or a rank's own log): a failed write is noted in the run's WriteFailures (watch()), not printed
    to stderr and forgotten as logging does."""

    failures: WriteFailures | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if isinstance(err, OSError) and self.failures is not None:
            self.failures.note(self.baseFilename, err, "log")
            return
        super().handleError(record)


def watch(failures: WriteFailures) -> None:
    """The run's log files report their failed writes to `failures`."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogHandler):
            handler.failures = failures

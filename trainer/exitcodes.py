"""What a trainer process's exit code says, and each rank's own record of it (srun merges the tasks' statuses).

| code      | meaning                                                      | what a restart loop does         |
|-----------|--------------------------------------------------------------|----------------------------------|
| 0         | done (or preempted, checkpointed and requeued by rank 0)     | nothing                          |
| 2         | usage or configuration error (bad flag, key, data file)      | never retried: it fails the same |
| 3         | non-finite loss                                              | never retried: it fails the same |
| 128 + N   | stopped by signal N after an agreed checkpoint (.preempted)  | requeue, not relaunch            |
| any other | a crash, an uncaught error, a signal without a checkpoint    | retryable                        |

    record_exit(run_dir, rank, code, cause)     # RUN_DIR/exits/rank-<N>.json
    kind_of(code, preempted=...)                # "done" | "usage" | "non-finite" | "preempted" | "retryable"
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

DONE, USAGE, NON_FINITE = 0, 2, 3
NEVER_RETRIED = {USAGE: "usage", NON_FINITE: "non-finite"}
EXITS_DIR = "exits"


def kind_of(code: int, preempted: bool = False) -> str:
    """The table's row of an exit code; `preempted`: the run directory holds the agreed-checkpoint marker."""
    if code == DONE:
        return "done"
    if code in NEVER_RETRIED:
        return NEVER_RETRIED[code]
    if code > 128 and preempted:
        return "preempted"
    return "retryable"


def record_exit(run_dir: str | Path, rank: int, code: int, cause: str, preempted: bool = False) -> Path | None:
    """This rank's exit, for the restart loop and `doctor --run`: RUN_DIR/exits/rank-<rank>.json (rank, host, pid,
    code, kind, cause, time, the job's restart count). None where the run directory cannot be written."""
    folder = Path(run_dir) / EXITS_DIR
    record = dict(rank=rank, host=socket.gethostname(), pid=os.getpid(), code=code, kind=kind_of(code, preempted),
                  cause=cause, time=round(time.time(), 3), restart=int(os.environ.get("SLURM_RESTART_COUNT", 0)))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank-{rank}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
        return path
    except OSError:
        return None

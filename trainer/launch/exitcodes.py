"""What a trainer process's exit code says, and each rank's own record of it (srun merges the tasks' statuses).

| code      | meaning                                                      | what a restart loop does         |
|-----------|--------------------------------------------------------------|----------------------------------|
| 0         | done (or preempted, checkpointed and requeued by rank 0)     | nothing                          |
| 2         | usage or configuration error (bad flag, key, data file)      | never retried: it fails the same |
| 3         | non-finite loss                                              | never retried: it fails the same |
| 4         | resource: a file the run must write cannot be written (disk  | never retried: a relaunch meets  |
|           | full, quota, read-only file system, permission: checkpoints, | the same disk and memory         |
|           | logs, metrics, the data cache), on every rank alike, or the  |                                  |
|           | model, its gradients and optimizer state exceed free memory  |                                  |
| 5         | unfit host: the pre-flight found a host slow or failing its  | relaunch without that host, at   |
|           | checks, or a straggler was evicted after a checkpoint         | once; stop where none is left    |
|           | (named in the cause: "unfit host(s) [h1,h2]")                 |                                  |
| 6         | hang: no rank made progress for faults.hang_timeout_s; one    | relaunch from the last agreed    |
|           | verdict for the group ("hang: rank R ...", or "hang: the     | checkpoint (counts in            |
|           | group ..." when all stalled alike), stacks in RUN_DIR/hangs/ | MAX_RESTARTS)                    |
| 7         | pruned: a search trial that the study's pruner stopped after | never retried: the study decided |
|           | a validation (search.*, hpc/submit.py --search)               |                                  |
| 128 + N   | stopped by signal N after an agreed checkpoint (.preempted)  | requeue, not relaunch            |
| any other | a crash, an uncaught error, a signal without a checkpoint    | retryable                        |

    record_start(run_dir, rank)                 # RUN_DIR/exits/rank-<N>.json says "running" until the exit
    record_exit(run_dir, rank, code, cause)     # ... and then the exit; a rank killed by a signal leaves "running"
    kind_of(code, preempted=...)                # "done" | "usage" | "non-finite" | "resource" | "preempted" | ...
    raise disk_error(path, err, "checkpoint")   # DiskError: one line naming the path, the error, the free space
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

DONE, USAGE, NON_FINITE, RESOURCE, UNFIT_HOST, HANG, PRUNED = 0, 2, 3, 4, 5, 6, 7
RUNNING = "running"       # the kind of a record whose process has not exited (or was killed without a word)
NEVER_RETRIED = {USAGE: "usage", NON_FINITE: "non-finite", RESOURCE: "resource", PRUNED: "pruned"}
# errors of writing that a relaunch on the same file system meets again
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


class ResourceError(RuntimeError):
    """What the run needs is not there (a disk to write, memory for the model): exit RESOURCE, never relaunched."""


class UnfitHostError(RuntimeError):
    """The pre-flight found hosts slow or failing (trainer/distributed/preflight.py): exit UNFIT_HOST; the restart
    loop relaunches without them. The cause names them as "unfit host(s) [h1,h2]" (unfit_hosts reads it back)."""

    def __init__(self, hosts: dict[str, str]):
        self.hosts = hosts
        super().__init__(f"pre-flight: unfit host(s) [{','.join(sorted(hosts))}]: "
                         + "; ".join(f"{h}: {why}" for h, why in sorted(hosts.items())))


class StragglerError(UnfitHostError):
    """A rank's host was a straggler under faults.straggler_action=evict (trainer/distributed/stragglers.py): after an
    agreed checkpoint, exit UNFIT_HOST as the pre-flight's; the cause says which check named it."""

    def __init__(self, host: str, why: str):
        RuntimeError.__init__(self, f"straggler: unfit host(s) [{host}]: {why}")
        self.hosts = {host: why}


def unfit_hosts(cause: str) -> list[str]:
    """The hosts an UnfitHostError's message names."""
    found = re.search(r"unfit host\(s\) \[([^\]]*)\]", cause or "")
    return [h for h in found.group(1).split(",") if h] if found else []


class DiskError(ResourceError):
    """The run directory (or a file in it) cannot be written."""


def is_disk_error(err: BaseException) -> bool:
    return isinstance(err, DiskError) or isinstance(err, OSError) and err.errno in DISK_ERRNOS


def is_resource_error(err: BaseException) -> bool:
    return isinstance(err, ResourceError) or is_disk_error(err)


def free_space(path: str | Path) -> str:
    """The free space of the file system holding path (its nearest existing parent), for messages."""
    target = Path(path)
    while not target.exists() and target.parent != target:
        target = target.parent
    try:
        free = shutil.disk_usage(target).free
    except OSError:
        return "free space unknown"
    if free >= 2**30:
        return f"{free / 2**30:.1f} GiB free"
    return f"{free / 2**20:.1f} MiB free" if free >= 2**20 else f"{free / 2**10:.0f} KiB free"


def disk_error(path: str | Path, err: BaseException, what: str = "", hint: str = "") -> DiskError:
    """A DiskError whose first line names what could not be written, the error and the free space there."""
    why = f"{os.strerror(err.errno)} (errno {errno.errorcode.get(err.errno, err.errno)})" \
        if isinstance(err, OSError) and err.errno else (str(err).splitlines()[0] if str(err) else type(err).__name__)
    text = f"could not write {what + ' ' if what else ''}{path}: {why}; {free_space(path)} there"
    return DiskError(text + (f".\nHINT: {hint}" if hint else ""))
EXITS_DIR = "exits"
PREEMPTED_MARKER = ".preempted"   # in the run directory while the last stop was a signal checkpoint (engine/loop.py)


def kind_of(code: int, preempted: bool = False) -> str:
    """The table's row of an exit code; `preempted`: the run directory holds the agreed-checkpoint marker."""
    if code == DONE:
        return "done"
    if code in NEVER_RETRIED:
        return NEVER_RETRIED[code]
    if code == UNFIT_HOST:
        return "unfit-host"
    if code == HANG:
        return "hang"
    if code > 128 and preempted:
        return "preempted"
    return "retryable"


def host_name() -> str:
    """The node as Slurm names it (what srun --exclude takes; several slurmds may share a host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def slurm_job_to_requeue(env) -> str | None:
    """SLURM_JOB_ID, or ARRAYID_TASKID inside a job array: one task's job id is the array's own (on Slurm
    22.05 the last task started), and `scontrol requeue` of it would restart every task."""
    if not env.get("SLURM_JOB_ID"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else env["SLURM_JOB_ID"]


def attempt_env() -> dict:
    """Which launch this process belongs to: the Slurm job, its requeue count and the restart loop's attempt."""
    env = os.environ
    return dict(job=env.get("SLURM_JOB_ID", ""), requeue=int(env.get("SLURM_RESTART_COUNT") or 0),
                attempt=int(env.get("TRAINER_ATTEMPT") or 0), restart=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0))


def record_start(run_dir: str | Path, rank: int) -> Path | None:
    """This rank is training: a record that stays "running" if the process dies without a word (SIGKILL, OOM
    killer, a lost node), so the restart loop still learns its host and pid."""
    return _write(run_dir, rank, dict(code=None, kind=RUNNING, cause="started"))


def record_exit(run_dir: str | Path, rank: int, code: int, cause: str, preempted: bool = False) -> Path | None:
    """This rank's exit, for the restart loop and `doctor --run`: RUN_DIR/exits/rank-<rank>.json (rank, host, pid,
    code, kind, cause, time, job, requeue, attempt). None where the run directory cannot be written."""
    return _write(run_dir, rank, dict(code=code, kind=kind_of(code, preempted), cause=cause))


def _write(run_dir: str | Path, rank: int, fields: dict) -> Path | None:
    folder = Path(run_dir) / EXITS_DIR
    record = dict(rank=rank, host=host_name(), pid=os.getpid(), **fields, time=round(time.time(), 3),
                  **attempt_env())
    path = folder / f"rank-{rank}.json"
    text = json.dumps(record) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
        return path
    except OSError:
        tmp.unlink(missing_ok=True)
    try:        # a full disk: over the start record in place, in the blocks it already holds
        with open(path, "r+") as fh:
            fh.write(text)
            fh.truncate()
        return path
    except OSError:
        return None

"""Who holds what in a cache shared by many jobs on many nodes: a build lock (one builder per entry across jobs)
and leases (an entry in use is never removed), both plain files that work on a local disk and on NFS.

    with BuildLock.take(root / ".sasrec-ab12.lock") as lock:    # None where a live owner holds it
        ...                                                     # build; lock.mine() before acting on the result
    lease = hold_lease(root / ".leases" / "sasrec-ab12")        # released at exit; live_leases() lists them

No `flock`: it does not reach across NFS clients. A lock is created whole by `link()` of a private file (fails
where the name exists, on NFSv3 too), broken by `rename()` (one breaker wins); its holder names itself (the Slurm
node name where there is one: the local cluster's nodes share a host name and a pid namespace), its pid and its
job, and touches the file every BEAT_S seconds. An owner is dead when its heartbeat is older than STALE_S, or,
on this node, when its pid is gone; a dead owner's lock is taken over by whoever finds it.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from trainer.launch.exitcodes import host_name, slurm_job_to_requeue

log = logging.getLogger(__name__)
BEAT_S = 1.0            # a build lock's heartbeat
STALE_S = 6.0           # a build lock not touched for this long is a dead builder's (waiters learn within 10 s)
LEASE_BEAT_S = 30.0     # a lease's heartbeat
LEASE_STALE_S = 300.0   # a lease not touched for this long is a dead job's


@dataclass(frozen=True)
class Owner:
    """A process that holds a lock or a lease: where it runs and what launched it."""

    node: str             # SLURMD_NODENAME, else the host name
    host: str
    pid: int
    job: str | None       # the Slurm job (ARRAY_TASK for an array task)
    launch: str           # the same for every rank of one launch, another for the next launch
    started: float        # this process's start (time.time() clock)
    token: str            # told apart from an earlier process of the same pid

    def __str__(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.node}{job}"

    @classmethod
    def of(cls, text: str) -> Owner | None:
        try:
            fields = json.loads(text)
            return cls(**{k: fields[k] for k in cls.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            return None


def launch_of(env=None) -> str:
    """What every rank of one launch shares and the next launch does not: the Slurm job, step and restart, torchrun's
    run id and restart, the rendezvous address; outside any launcher this process's parent on this node."""
    env = os.environ if env is None else env
    parts = [env.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                                      "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")]
    if not any(parts):
        parts = [host_name(), str(os.getppid())]
    return "/".join(parts)


def started_of(pid: int | str = "self") -> float | None:
    """When a process of this node started (time.time()'s clock, to a clock tick): from /proc, its start in ticks
    since boot against the time since boot now."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_ME: dict[int, Owner] = {}      # per pid: a forked child is another owner


def me() -> Owner:
    """This process as an owner."""
    pid = os.getpid()
    if pid not in _ME:
        _ME[pid] = Owner(host_name(), socket.gethostname(), pid, slurm_job_to_requeue(os.environ), launch_of(),
                         started_of() or time.time(), secrets.token_hex(6))
    return _ME[pid]


def alive_here(owner: Owner) -> bool:
    """The owner's process still runs on this node (not a later process given its pid)."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process
        pass
    started = started_of(owner.pid)
    return started is None or abs(started - owner.started) < 2.0


def dead_reason(owner: Owner | None, mtime: float, stale_s: float, now: float | None = None) -> str | None:
    """Why the holder of a file touched at mtime is dead (None: it may be alive)."""
    now = time.time() if now is None else now
    if owner is not None and owner.node == host_name() and not alive_here(owner):
        return f"{owner} is gone"
    if now - mtime > stale_s:
        return f"{owner or 'its holder'} has not been heard of for {now - mtime:.0f} s"
    return None


def private_name(path: Path) -> Path:
    """A temporary name beside path that no other process (on any node) uses."""
    owner = me()
    return path.with_name(f".{path.name}.{owner.node}.{owner.pid}.{owner.token}.tmp")


def _write_owned(path: Path) -> Path:
    tmp = private_name(path)
    tmp.write_text(json.dumps(asdict(me())))
    return tmp


# The build lock's heartbeat runs in a process of its own: a parse in C++ holds this one's GIL for seconds. It
# stops when its parent or the lock is gone.
_BEAT = ("import os, sys, time\n"
         "parent, path, every = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])\n"
         "try:\n"
         "    while os.getppid() == parent:\n"
         "        os.utime(path)\n"
         "        time.sleep(every)\n"
         "except OSError:\n"
         "    pass\n")


class BuildLock:
    """One builder at a time, across processes, jobs and nodes; touched every BEAT_S while held."""

    def __init__(self, path: Path):
        self.path = path
        self._beat = subprocess.Popen([sys.executable, "-S", "-c", _BEAT, str(os.getpid()), str(path), str(BEAT_S)],
                                      stdin=subprocess.DEVNULL, close_fds=True)

    @classmethod
    def take(cls, path: Path) -> BuildLock | None:
        """The lock, or None where a live owner holds it (a dead owner's lock is taken over, and said)."""
        tmp = _write_owned(path)
        try:
            for _ in range(3):
                try:
                    os.link(tmp, path)
                    return cls(path)
                except FileExistsError:
                    if not break_if_dead(path, STALE_S):
                        return None
            return None
        finally:
            tmp.unlink(missing_ok=True)

    def holder(self) -> Owner | None:
        return holder_of(self.path)

    def mine(self) -> bool:
        """Still held by this process (a stalled holder's lock may have been taken over)."""
        holder = self.holder()
        return holder is not None and holder.token == me().token

    def release(self) -> None:
        self._beat.kill()
        self._beat.wait()
        if self.mine():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> BuildLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def exclusive(path: Path, what: str, report_s: float = 15.0, poll_s: float = 0.5) -> Iterator[BuildLock]:
    """Hold the lock at path for a short piece of shared work (a folder's frame extraction): wait while a live owner
    holds it (saying whom for what), take it over from a dead one."""
    start = time.monotonic()
    last = start - report_s
    while (lock := BuildLock.take(path)) is None:
        if time.monotonic() - last >= report_s:
            log.info("waiting for %s to %s (%.0f s)", holder_of(path) or "another process", what,
                     time.monotonic() - start)
            last = time.monotonic()
        time.sleep(poll_s)
    with lock:
        yield lock


def holder_of(path: Path) -> Owner | None:
    try:
        return Owner.of(path.read_text())
    except OSError:
        return None


def break_if_dead(path: Path, stale_s: float) -> bool:
    """Remove the lock at path if its holder is dead (True: it is gone now, by us or another)."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return True
    holder = holder_of(path)
    why = dead_reason(holder, mtime, stale_s)
    if why is None:
        return False
    corpse = private_name(path).with_suffix(".dead")
    try:
        os.rename(path, corpse)            # one breaker wins; the others find the name gone
    except FileNotFoundError:
        return True
    taken = holder_of(corpse)
    if holder is not None and taken is not None and taken.token != holder.token:
        try:                               # a live owner's lock made in between: handed back
            os.link(corpse, path)
        except FileExistsError:
            pass
        corpse.unlink(missing_ok=True)
        return False
    corpse.unlink(missing_ok=True)
    log.warning("%s: taken over (%s)", path, why)
    return True


# ------------------------------------------------------------------------------ leases

class _Leases:
    """The leases this process holds: touched every LEASE_BEAT_S by one thread, removed at exit."""

    def __init__(self):
        self.held: set[Path] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, path: Path) -> None:
        with self.lock:
            self.held.add(path)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._heartbeat, daemon=True, name="cache leases")
                self.thread.start()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(LEASE_BEAT_S)
            with self.lock:
                for path in list(self.held):
                    try:
                        os.utime(path)
                    except OSError:
                        self.held.discard(path)

    def release_all(self) -> None:
        with self.lock:
            for path in self.held:
                if path.name.endswith(f".{os.getpid()}.{me().token}.lease"):
                    path.unlink(missing_ok=True)
            self.held.clear()


_LEASES = _Leases()
atexit.register(_LEASES.release_all)


def hold_lease(folder: Path) -> Path | None:
    """A lease on what folder names (ROOT/.leases/ENTRY) for as long as this process lives; None where the cache
    cannot be written (a read-only cache: nothing there is ever removed by a job)."""
    owner = me()
    path = folder / f"{owner.node}.{owner.pid}.{owner.token}.lease"
    if path in _LEASES.held:
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(owner)))
    except OSError:
        return None
    _LEASES.add(path)
    return path


def live_leases(folder: Path) -> list[Owner]:
    """The owners of folder's live leases; dead ones are removed on the way."""
    live = []
    for path in folder.glob("*.lease") if folder.is_dir() else ():
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        owner = holder_of(path)
        if dead_reason(owner, mtime, LEASE_STALE_S) is None:
            live.append(owner or Owner("?", "?", 0, None, "", 0.0, path.name))
        else:
            path.unlink(missing_ok=True)
    return live

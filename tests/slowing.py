"""Slowing a rank or a host on purpose, for the tests that judge speed (the pre-flight, the straggler watch,
eviction; marker `timing`): the slowed processes under a CPU quota (a cgroup of the cpu controller: at most
SLOW_SHARE of one core, whatever else the machine runs), the fast ones in a cgroup of many times a session's weight;
a rank slowed from its first logging window to its exit record. A quota is a ceiling, not a share: a loaded machine
can only slow the fast side, and by the fast group's weight (FAST_SHARES against a busy session's 1024) not much,
so a slowed rank stays 10-20x behind with two busy loops beside the test (tests/under_load.sh)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.procs import PY

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")      # cgroup v1's cpu controller (cpu.cfs_quota_us, cpu.shares)
SLOW_SHARE = 0.05          # of one core: a slowed process's ceiling
QUOTA_PERIOD_US = 20_000   # its quota's period: bursts of at most 1 ms (0.05 x 20 ms) run at full speed
FAST_SHARES = 10_240       # ten sessions' weight: the fast side keeps most of a core beside busy loops
# A test marked timing runs, with what it starts, in a group of as much weight as the fast side (the tests the other
# workers of make test run beside it, a session of 1024 each, take what it leaves). No more than that: a timing
# test's group above the fast group starved the fast rank of a slowed-rank test beside it (a pre-flight measured
# 3.7 against 6.3 GFLOP/s), and far above a session (cgroup v1's largest, 262144, tried for video's default rows)
# it starved every other test for minutes (a `doctor` past its 60 s). The video rows that keep both cores busy take
# the machine to themselves instead (tests/cluster.py machine_turn).
TIMING_SHARES = FAST_SHARES
# Without a writable cpu controller (not root, or cgroup v2 without the cpu controller delegated): the older way,
# the slowed process niced beside busy loops on one core (about a twentieth of it on an idle machine; a load beside
# the test changes that share, so there the verdicts are not load-proof, and quota_reason() says why).
SLOWED_NICE = 10
FAST_NICE = -10


def quota_reason() -> str | None:
    """None when a CPU quota can slow a process here, else why not."""
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}"
    if not os.access(CPU_CGROUP, os.W_OK):
        return f"{CPU_CGROUP} is not writable (not root)"
    return None


def _cgroup_of(pid: int) -> Path | None:
    """The cpu controller's cgroup the process is in now (None once it has exited)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return CPU_CGROUP / path.lstrip("/")
    return None


def _remove_stale_groups() -> None:
    """The groups of a test process that died before it removed them (killed): what they still hold goes back to the
    root group, so nothing stays slowed after its test."""
    for root in [*CPU_CGROUP.glob("hpc-trainer-test-*"), *CPU_CGROUP.glob("hpc-trainer-timing-*")]:
        owner = int(root.name.split("-")[3])
        if Path(f"/proc/{owner}").exists():
            continue
        for group in (root / "slow", root / "fast", root):
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (CPU_CGROUP / "cgroup.procs").write_text(pid)
                group.rmdir()


class CpuGroups:
    """Two cgroups of this test process's own, `slow` (the quota) and `fast` (the weight); processes moved in are
    moved back where they were by close(), which removes the groups."""

    def __init__(self) -> None:
        _remove_stale_groups()
        self.root = CPU_CGROUP / f"hpc-trainer-test-{os.getpid()}-{threading.get_ident()}"
        self.slow, self.fast = self.root / "slow", self.root / "fast"
        for group in (self.slow, self.fast):
            group.mkdir(parents=True, exist_ok=True)
        (self.slow / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
        (self.slow / "cpu.cfs_quota_us").write_text(str(int(SLOW_SHARE * QUOTA_PERIOD_US)))
        (self.fast / "cpu.shares").write_text(str(FAST_SHARES))
        self.home: dict[int, Path] = {}        # pid -> the cgroup it came from

    def put(self, pid: int, group: Path) -> None:
        """Move the process (every thread of it: cgroup.procs) into the group; a process gone meanwhile is left."""
        if pid in self.home and _cgroup_of(pid) == group:
            return
        where = _cgroup_of(pid)
        if where is None:
            return
        self.home.setdefault(pid, where)
        with contextlib.suppress(OSError):           # (exited between the read and the move)
            (group / "cgroup.procs").write_text(str(pid))

    def release(self) -> None:
        """Every process still in the groups back where it came from (the root group for one that came in as a
        child of a moved process)."""
        for group in (self.slow, self.fast):
            with contextlib.suppress(OSError):
                for line in (group / "cgroup.procs").read_text().split():
                    pid = int(line)
                    with contextlib.suppress(OSError):
                        (self.home.get(pid, CPU_CGROUP) / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        self.release()
        for group in (self.slow, self.fast, self.root):
            with contextlib.suppress(OSError):
                group.rmdir()


@contextlib.contextmanager
def timing_share(item) -> Iterator[None]:
    """A test marked timing runs in a cpu cgroup of its own of TIMING_SHARES, this process and every process it starts
    meanwhile (a child inherits its group), so that the load of other tests beside it (make test's workers) cannot
    move its verdict much; back in its own group after, its leftovers in the root group. Without a writable cpu
    controller: as it is (its reason printed)."""
    if item.get_closest_marker("timing") is None:
        yield
        return
    if (reason := quota_reason()) is not None:
        print(f"timing: no cpu share of its own here ({reason}): a load beside the test can change its verdict",
              file=sys.stderr)
        yield
        return
    _remove_stale_groups()
    group = CPU_CGROUP / f"hpc-trainer-timing-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cpu.shares").write_text(str(TIMING_SHARES))
    home = _cgroup_of(os.getpid()) or CPU_CGROUP
    (group / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            (home / "cgroup.procs").write_text(str(os.getpid()))
            for pid in (group / "cgroup.procs").read_text().split():     # what it started and left running
                with contextlib.suppress(OSError):
                    (CPU_CGROUP / "cgroup.procs").write_text(pid)
            group.rmdir()


def pin(pid: int, cores: set[int], nice: int | None = None) -> None:
    """Without a quota: every thread of the process on `cores` (a thread keeps the mask it started with); `nice`:
    its session's scheduler nice value (sched_autogroup shares a core between sessions before it shares within
    one)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cores)
        if nice is not None:        # (FAST_NICE without root: refused, and the suppress above lets it go)
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def two_cores() -> tuple[int, int]:
    """(fast, slow): the cores a slowed test uses without a quota."""
    fast, slow = sorted(os.sched_getaffinity(0))[:2]
    return fast, slow


@contextlib.contextmanager
def busy_core(core: int, loops: int = 2):
    """Busy loops on `core`, in a session of their own (a full session's weight there, whatever else runs)."""
    busy = [subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True) for _ in range(loops)]
    try:
        for p in busy:
            os.sched_setaffinity(p.pid, {core})
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


@contextlib.contextmanager
def _slowing(slow_pids: Callable[[], list[int]], fast_pids: Callable[[], list[int]]) -> Iterator[Callable[[], None]]:
    """Yields the function that applies the slowing to the processes named now; undone when the block ends."""
    if quota_reason() is None:
        groups = CpuGroups()

        def apply() -> None:
            for pid in slow_pids():
                groups.put(pid, groups.slow)
            for pid in fast_pids():
                groups.put(pid, groups.fast)
        try:
            yield apply
        finally:
            groups.close()
        return
    fast, slow = two_cores()

    def apply_niced() -> None:
        for pid in slow_pids():
            pin(pid, {slow}, nice=SLOWED_NICE)
        for pid in fast_pids():
            pin(pid, {fast}, nice=FAST_NICE)
    with busy_core(slow):
        try:
            yield apply_niced
        finally:
            for pid in slow_pids() + fast_pids():        # (a session that outlives it is not left slowed)
                pin(pid, os.sched_getaffinity(0), nice=0)


@contextlib.contextmanager
def slowed(slow_pids: Callable[[], list[int]], fast_pids: Callable[[], list[int]],
           once: Callable[[], bool] = lambda: True, until: Callable[[], bool] = lambda: False):
    """The processes slow_pids() names under the CPU quota (at most SLOW_SHARE of a core), those fast_pids() names
    in the heavy group, from when once() is true until until() is or the block ends; then back where they were.
    Applied again every 50 ms, so a process started meanwhile is caught within 50 ms (its children inherit its
    group at once). Without a quota (quota_reason()): niced beside busy loops, as the module's docstring says; then a
    process's session must be its own (a session's nice is all of its processes')."""
    ended = threading.Event()
    failed: list[BaseException] = []
    if (reason := quota_reason()) is not None:
        print(f"slowed: no CPU quota here ({reason}): niced beside busy loops instead, a share a load can change",
              file=sys.stderr)

    def keep_slowed() -> None:
        try:
            while not once():
                if ended.wait(0.01):
                    return
            with _slowing(slow_pids, fast_pids) as apply:
                while True:
                    apply()
                    if ended.wait(0.05) or until():
                        break
        except BaseException as err:       # re-raised in the test's thread
            failed.append(err)

    watcher = threading.Thread(target=keep_slowed, name="slowed", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        ended.set()
        watcher.join()
    if failed:
        raise failed[0]


def slowed_rank(procs: list[subprocess.Popen], rank: int, once: Callable[[], bool] | None = None,
                until: Callable[[], bool] | None = None):
    """slowed() for procs[rank] against every other rank, until a rank exits at the latest. once: slowed from when
    this is true (a run directory's metrics.jsonl exists: the first logging window is done), so the ranks' start
    (importing torch, and what the first step imports: seconds of CPU, a minute at a twentieth) runs at full speed;
    until: back to full speed when this is true (run_ended: the rank's shutdown is not under test). Without them:
    from the start. The ranks must run in sessions of their own (launch_ranks(own_sessions=True))."""
    if any(os.getsid(p.pid) != p.pid for p in procs):
        raise ValueError("slowed_rank: start the ranks in sessions of their own (launch_ranks(own_sessions=True))")

    def exited() -> bool:
        return any(p.poll() is not None for p in procs)
    return slowed(lambda: [procs[rank].pid], lambda: [p.pid for r, p in enumerate(procs) if r != rank],
                  once=lambda: exited() or once is None or once(),
                  until=lambda: exited() or (until is not None and until()))


def run_ended(run_dir: Path, rank: int) -> Callable[[], bool]:
    """Whether the rank has recorded its exit (RUN_DIR/exits/rank-N.json with a code: its run is over, its
    shutdown starts)."""
    import json
    record = Path(run_dir) / "exits" / f"rank-{rank}.json"

    def ended() -> bool:
        try:
            return json.loads(record.read_text())["code"] is not None
        except (OSError, ValueError, KeyError):
            return False
    return ended

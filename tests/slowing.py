"""Slowing a rank or a host on purpose, for the tests that judge speed (the pre-flight, the straggler watch,
eviction): cores pinned and niced, busy loops on a core, a rank slowed from its first logging window to its exit
record."""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from tests.procs import PY

SLOWED_NICE = 10   # a slowed session's nice: weight 110 against a busy session's 1024, about a twentieth of a core
# the fast rank's session: weight 9548, most of its core whatever else runs there. The load balancer sends other
# work to the fast core (the slow one is full): at nice 0 a CI run's fast rank got a third of it, and the factor
# between the ranks fell from 10 to 1.8-3.7. Root only (a lower nice needs CAP_SYS_NICE); elsewhere it stays 0.
FAST_NICE = -10


def pin(pid: int, cores: set[int], nice: int | None = None) -> None:
    """Every thread of the process on `cores` (a thread keeps the mask it started with); `nice`: its session's
    scheduler nice value. The kernel shares a core fairly between sessions before it shares within one
    (sched_autogroup): busy loops in the slowed process's own session would take little from it, and a fast
    process in the test's session, whose weight sits where its busy loops run, would lose its core to any other
    session (a CI run saw 1-3.7x where 16x was meant, the suite's other half running beside it)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cores)
        if nice is not None:        # (FAST_NICE without root: refused, and the suppress above lets it go)
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def two_cores() -> tuple[int, int]:
    """(fast, slow): the cores a slowed test uses."""
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
def slowed(slow_pids: Callable[[], list[int]], fast_pids: Callable[[], list[int]],
           once: Callable[[], bool] = lambda: True, until: Callable[[], bool] = lambda: False):
    """The processes slow_pids() names on one core beside busy loops, their sessions at SLOWED_NICE (about a
    twentieth of that core), those fast_pids() names on the other core, from when once() is true until until() is
    or the block ends; then back on every core at nice 0. Re-pinned every 50 ms, so a process started meanwhile is
    caught within 50 ms. A process's session must be its own (a session's nice is all of its processes')."""
    fast, slow = two_cores()
    ended = threading.Event()
    failed: list[BaseException] = []

    def keep_slowed() -> None:
        try:
            while not once():
                if ended.wait(0.01):
                    return
            with busy_core(slow):
                while True:
                    for pid in slow_pids():
                        pin(pid, {slow}, nice=SLOWED_NICE)
                    for pid in fast_pids():
                        pin(pid, {fast}, nice=FAST_NICE)
                    if ended.wait(0.05) or until():
                        break
            for pid in slow_pids() + fast_pids():        # (a session that outlives it is not left slowed)
                pin(pid, os.sched_getaffinity(0), nice=0)
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

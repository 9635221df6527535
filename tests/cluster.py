"""The local Slurm cluster of the tests (hpc/cluster/): the halves of the suite (the cluster's tests and the CPU work
beside them, the rest), whether a cluster runs, and the environment pointed at it (the slurm_cluster fixture itself
lives in tests/conftest.py)."""
from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import subprocess
from pathlib import Path
from typing import Iterator

from tests.locks import file_lock
from tests.procs import clean_env

# ------------------------------------------------------------------ local Slurm cluster
PARTS = ("cluster", "rest")


def in_cluster_half(item) -> bool:
    """The cluster half: the tests on the cluster; with the rest half in one process (TEST_WORKERS=1, the default)
    also the long CPU work marked long. That half mostly waits on the scheduler (CI,
    2026-11-27: 17 minutes against the other half's 40), so it takes the long CPU tests that need no cluster. With the
    rest in several workers they are the rest's (CI, 2026-12-07: the cluster half 38 minutes with them beside two
    workers; 21.5 without them)."""
    if item.get_closest_marker("slurm") is not None:
        return True
    return item.get_closest_marker("long") is not None and os.environ.get("TEST_WORKERS", "1") == "1"


def long_modules_first(items: list) -> list:
    """The modules with tests marked long or timing first, most such tests first, each module's tests together and in
    their order (its module fixtures are then set up once a worker): pytest-xdist hands tests out in this order, so
    the long ones start early and the quick ones fill the workers at the end (CI, 2026-12-07: with the hang watch's
    31 timing tests collected late, one worker ran their timeouts alone for the last minutes while the others
    idled)."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]
    weight = collections.Counter(module(i) for i in items
                                 if i.get_closest_marker("long") or i.get_closest_marker("timing"))
    return sorted(items, key=lambda i: -weight[module(i)])        # stable: a module's tests keep their order


def cluster_running(where: Path | None) -> bool:
    pid = where / "slurmctld.pid" if where else None
    return bool(pid and pid.exists() and subprocess.run(["kill", "-0", pid.read_text().strip()]).returncode == 0)


# The test cluster's nodes are one machine's two cores, shared with the rest of the suite: a host of a job that is
# not about slowness was found at 0.39x and 0.45x for seconds on end (CI, 2026-11-29), so its jobs judge as a site
# whose nodes are shared would (TRAINER_PREFLIGHT_SLOW); a slowed node (test_slow_node.py) is 0.05x, a slowed
# link (test_slow_link.py) 0.1x or less: both still named.
SHARED_NODES_SLOW = "0.2"


def slurm_env(conf: Path, **extra: str) -> dict[str, str]:
    """Clean environment pointed at the test cluster."""
    return clean_env(SLURM_CONF=str(conf), TRAINER_PREFLIGHT_SLOW=SHARED_NODES_SLOW, **extra)


# ------------------------------------------------------------------ the cluster shared by several workers
# tests/run.sh runs the cluster half in TEST_CLUSTER_WORKERS pytest-xdist workers (its tests mostly wait on the
# scheduler). Two kinds of test cannot share the cluster: those that preempt every job on the nodes (a `high`
# partition job) and those that slow a node's processes: they are marked cluster_alone and run with the cluster
# to themselves; every other test on the cluster shares it with the other worker's.


@contextlib.contextmanager
def _shared_or_alone(name: str, alone: bool) -> Iterator[None]:
    """The lock NAME shared, or exclusive when alone; one waiting to be alone holds NAME's gate, so that the other
    workers' next tests wait behind it instead of keeping the lock shared."""
    with contextlib.ExitStack() as held:
        with file_lock(f"{name}-gate"):
            held.enter_context(file_lock(f"{name}-turn", fcntl.LOCK_EX if alone else fcntl.LOCK_SH))
        yield


@contextlib.contextmanager
def cluster_turn(item) -> Iterator[None]:
    """A test's turn on the cluster, held over its setup, call and teardown (its module's fixtures included): shared,
    or exclusive for a test marked cluster_alone; nothing for a test off the cluster."""
    if item.get_closest_marker("slurm") is None:
        yield
        return
    with _shared_or_alone("cluster", item.get_closest_marker("cluster_alone") is not None):
        yield


@contextlib.contextmanager
def machine_turn(item) -> Iterator[None]:
    """Every test shares the machine, but a test marked timing(machine=True) has it to itself, across every worker of
    both halves: a verdict on a run that keeps both cores busy for minutes (video's default-size rows of the hang
    watch: beside three workers a default step took 44-100 s instead of 9-13; a weight large enough to keep it at
    speed starved every other test, tests/slowing.py). The others wait before they start, not inside a timeout."""
    mark = item.get_closest_marker("timing")
    with _shared_or_alone("machine", mark is not None and bool(mark.kwargs.get("machine"))):
        yield


@contextlib.contextmanager
def named_turns(item) -> Iterator[None]:
    """Tests marked one_at_a_time(NAME) run one at a time across every worker of both halves (a file lock per name,
    held over the test's setup, call and teardown): those that share a fixed resource (a second cluster's network
    namespaces) or need much of the machine's memory (video at its defaults: ~6 GB a process). pytest-xdist's own
    xdist_group does not group here (pytest 9 with xdist 3.8: the tests of one group ran on two workers at once)."""
    with contextlib.ExitStack() as held:
        for name in sorted({m.args[0] for m in item.iter_markers("one_at_a_time")}):    # one order: no deadlock
            held.enter_context(file_lock(f"turn-{name}"))
        yield


def starting_lock():
    """One worker at a time looks for the cluster and starts it if none runs (the other then finds it running)."""
    return file_lock("cluster-start")


# A worker that started the cluster leaves it to the controller, which stops it once every worker is done: the file
# named by this variable (set by the controller, read by its workers) holds the started cluster's directory.
STARTED_VAR = "TEST_CLUSTER_STARTED_FILE"

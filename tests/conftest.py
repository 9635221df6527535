"""The suite's fixtures and collection hook; the helpers live by concern: tests/procs.py (the trainer and ranks as
subprocesses, the environment, weights compared), tests/slowing.py (a rank or host slowed on purpose),
tests/cluster.py (the local Slurm cluster), tests/inprocess.py (the command line inside the test process). Their
names stay importable from here, as the tests import them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster import (  # noqa: F401
    PARTS,
    SHARED_NODES_SLOW,
    STARTED_VAR,
    cluster_running,
    cluster_turn,
    file_lock,
    in_cluster_half,
    long_modules_first,
    machine_turn,
    named_turns,
    slurm_env,
    starting_lock,
)
from tests.procs import (  # noqa: F401
    LAUNCH_VARS,
    PY,
    REPO,
    assert_bitwise_equal,
    assert_close,
    clean_env,
    eval_one_and_three,
    free_port,
    launch_ranks,
    record_fault,
    run_group,
    run_ranks,
    train_until_sigterm,
    trainer,
    wait_all,
    weights,
)
from tests.slowing import (  # noqa: F401
    FAST_NICE,
    SLOWED_NICE,
    busy_core,
    pin,
    quota_reason,
    run_ended,
    slowed,
    slowed_rank,
    timing_share,
    two_cores,
)
from tests.timeouts import limit


@pytest.fixture
def busy_core_turn():
    """Without a CPU quota (tests/slowing.py quota_reason()), the tests that slow a rank with busy loops on one core
    take turns, across the suite's two halves (make test runs them side by side): two at once would load each
    other's fast core too (a CI run saw a pre-flight test's fast rank at 6.2 GFLOP/s against its slowed one's 4.0
    while a cluster test slowed a node). A file lock in /tmp, held for the whole test. Under a quota, nothing to
    share: each test's slowed processes have their own ceiling."""
    if quota_reason() is None:
        yield
        return
    with file_lock("busy-core"):
        yield


@pytest.hookimpl(tryfirst=True)       # before -m selects: `-m slurm` then means every test on the cluster
def pytest_collection_modifyitems(config, items):
    """Every test that uses the local cluster is marked slurm. TEST_PART=cluster keeps those and the ones marked
    long (with TEST_WORKERS=1), TEST_PART=rest the others: tests/run.sh runs the two halves side by side."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)
    part = os.environ.get("TEST_PART", "")
    if part and part not in PARTS:
        raise pytest.UsageError(f"TEST_PART={part!r}: expected one of {', '.join(PARTS)} (or unset: every test)")
    if part:
        keep = [i for i in items if in_cluster_half(i) == (part == "cluster")]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if hasattr(config, "workerinput"):      # pytest-xdist's workers take tests in this order; one process keeps its own
        items[:] = long_modules_first(items)


def pytest_configure(config):
    """The controller of pytest-xdist workers (or a plain session) names the file where a worker that starts the
    local cluster leaves its directory, so that the cluster outlives that worker's session until every worker is done
    (pytest_sessionfinish below stops it). Its own, never one inherited: a pytest run inside a test must not stop the
    cluster of the run around it."""
    if not hasattr(config, "workerinput"):
        import tempfile
        os.environ[STARTED_VAR] = str(Path(tempfile.gettempdir()) / f"hpc-trainer-tests-{os.getpid()}.cluster")


def pytest_sessionfinish(session, exitstatus):
    flag = Path(os.environ.get(STARTED_VAR, "/nonexistent"))
    if hasattr(session.config, "workerinput") or not flag.is_file():
        return
    env = dict(os.environ, HPC_CLUSTER_DIR=flag.read_text().strip())
    subprocess.run(["bash", str(REPO / "hpc/cluster/stop.sh")], env=env, timeout=limit("run"))
    flag.unlink()


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local Slurm cluster (started here if not running; stopped at the end if this session started it: by this
    fixture in one process, by the controller once every pytest-xdist worker is done)."""
    from hpc.slurm_info import local_cluster_dir
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip("Slurm is not installed (run `make slurm-install`, or `make test` which does it)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (mknod, /etc/hosts)")
    with starting_lock():                 # the workers of one half look for it one at a time
        running = cluster_running(local_cluster_dir())
        if not running:
            subprocess.run(["bash", str(REPO / "hpc/cluster/start.sh")], check=True, timeout=limit("runs"))
    where = local_cluster_dir()
    ours = not running and not os.environ.get("PYTEST_XDIST_WORKER")     # a worker's start is the controller's to stop
    if not running and not ours:
        Path(os.environ[STARTED_VAR]).write_text(str(where))
    env = dict(os.environ, HPC_CLUSTER_DIR=str(where))
    yield where / "slurm.conf"
    if ours:
        subprocess.run(["bash", str(REPO / "hpc/cluster/stop.sh")], env=env, timeout=limit("run"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked one_at_a_time waits for its name's turn, a test on the cluster for its turn there (shared, or
    alone), a test that needs the whole machine for it (tests/cluster.py); a test marked timing runs in a CPU share
    of its own (tests/slowing.py).
    TEST_CPU_REPORT=FILE: one JSON line per test with its wall time and the CPU seconds it took (this process's and
    its finished children's, user + system): where a suite on 2 cores spends its CPU, which wall times hide (a test
    that sleeps or waits on the scheduler costs wall, not CPU)."""
    with named_turns(item), cluster_turn(item), machine_turn(item), timing_share(item):   # outside the times
        target = os.environ.get("TEST_CPU_REPORT")
        if not target:
            yield
            return
        import json
        import resource
        import time

        def cpu() -> float:
            own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
        start, wall = cpu(), time.monotonic()
        yield
        with open(target, "a") as fh:
            fh.write(json.dumps(dict(test=item.nodeid, part=os.environ.get("TEST_PART", ""),
                                     wall_s=round(time.monotonic() - wall, 2), cpu_s=round(cpu() - start, 2))) + "\n")


@pytest.fixture(scope="module")
def page_data(tmp_path_factory):
    """The data the pages' commands read (tests/pages.py), written once for a module's sandboxes."""
    from tests.pages import write_data
    data = tmp_path_factory.mktemp("page-data") / "data"
    write_data(data)
    return data

"""Shared helpers: run the trainer as real subprocesses, launch ranks, start the local Slurm cluster."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SUBMITIT_EXECUTOR")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, with the toy recipe plugged in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARS}
    # PYTHONFAULTHANDLER: a rank that wait_all stops for hanging (SIGABRT) prints where every thread was
    env.update(TRAINER_PLUGINS="tests.toy_recipe", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def record_fault(fault: str, **figures) -> None:
    """A measured figure of a fault test (time to exit, steps lost), appended as one JSON line to the file
    named by FAULT_FIGURES (make faults-report); nothing when it is unset. The README's fault table is
    made from these lines."""
    target = os.environ.get("FAULT_FIGURES")
    if target:
        import json
        with open(target, "a") as fh:
            fh.write(json.dumps(dict(fault=fault, **figures), sort_keys=True) + "\n")


@pytest.fixture
def busy_core_turn():
    """The tests that slow a rank with busy loops on one core take turns, across the suite's two halves (make test
    runs them side by side): two at once would load each other's fast core too (a CI run saw a pre-flight test's
    fast rank at 6.2 GFLOP/s against its slowed one's 4.0 while a cluster test slowed a node). A file lock in /tmp,
    held for the whole test."""
    import fcntl
    import tempfile
    with open(Path(tempfile.gettempdir()) / "hpc-trainer-busy-core.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def free_port() -> int:
    """A TCP port that is free right now on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(*args: str, env: dict | None = None, timeout: float = 180, check: bool = True):
    """Run `python -m trainer ARGS` in a clean environment; returns the CompletedProcess."""
    proc = subprocess.run([PY, "-m", "trainer", *args], cwd=REPO, env=env or clean_env(), text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def launch_ranks(n: int, *args: str, extra_env: dict | None = None, rank_env: list[dict] | None = None,
                 own_sessions: bool = False, wrap=None) -> list[subprocess.Popen]:
    """Start n ranks of `python -m trainer ARGS` with the variables torchrun would set; extra_env and rank_env (each
    rank's own: its host name) add to them or replace them; own_sessions: each rank in a session of its own
    (slowed_rank needs it); wrap(rank, argv): the argv that runs it (inside a node's network namespace)."""
    port = free_port()
    procs = []
    for rank in range(n):
        env = clean_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(extra_env or {})
        env.update(rank_env[rank] if rank_env else {})
        argv = [PY, "-m", "trainer", *args]
        procs.append(subprocess.Popen(wrap(rank, argv) if wrap else argv, cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=own_sessions))
    return procs


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


def wait_all(procs: list[subprocess.Popen], timeout: float = 180) -> list[tuple[int, str]]:
    """(returncode, stderr) of every rank. If they are not all done within timeout seconds, the ranks still
    running are stopped with SIGABRT (faulthandler prints each thread's stack) and the test fails with every
    rank's stderr tail, so a hang names where it hung."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            out.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks still running after {timeout:.0f} s:\n{_stop_hung(procs)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _tree(pid: int) -> list[int]:
    """pid and every process descended from it (a torchrun agent's workers run in sessions of their own, so
    a process group does not reach them; their parent links do)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += parents.get(found[-1], [])
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in reversed(pids):                 # the workers before the agent that watches them
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop_hung(procs: list[subprocess.Popen]) -> str:
    """SIGABRT the ranks still running and everything they started (faulthandler prints each one's stacks),
    then SIGKILL what is left; every rank's stderr tail (with the stacks)."""
    trees = {p.pid: _tree(p.pid) for p in procs if p.poll() is None}
    for pids in trees.values():
        _signal_all(pids, signal.SIGABRT)
    tails = []
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            _signal_all(trees.get(p.pid, [p.pid]), signal.SIGKILL)
            try:
                _, err = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                err = "(no stderr: its pipe is held open by a process outside its tree)"
        tails.append(f"--- rank {rank} (exit {p.returncode}) ---\n{(err or '')[-20000:]}")   # its workers too
    return "\n".join(tails)


def run_group(argv: list[str], env: dict, timeout: float = 300) -> tuple[int, str]:
    """(returncode, stderr) of ARGV (a launcher and everything it starts); a hang past timeout seconds fails
    the test with the stacks of every process it started."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return wait_all([proc], timeout)[0]


def run_ranks(n: int, *args: str, timeout: float = 180, extra_env: dict | None = None) -> list[tuple[int, str]]:
    """launch_ranks + wait_all, asserting every rank exited 0."""
    results = wait_all(launch_ranks(n, *args, extra_env=extra_env), timeout)
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-4000:]}"
    return results


def weights(run_dir: Path, name: str = "final.pt") -> dict[str, torch.Tensor]:
    """Model weights of a run's checkpoint."""
    return torch.load(Path(run_dir) / "checkpoints" / name, weights_only=True)["model"]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k] - b[k]).abs().max().item()}"


def assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= tol, f"{k} differs by {diff} > {tol}"


# ------------------------------------------------------------------ local Slurm cluster
PARTS = ("cluster", "rest")


def in_cluster_half(item) -> bool:
    """The cluster half: the tests on the cluster, and CPU work marked beside_cluster. That half mostly waits on the
    scheduler (CI, 2026-11-27: 17 minutes against the other half's 40), so it takes the long CPU tests that need
    no cluster and the suite ends sooner."""
    return item.get_closest_marker("slurm") is not None or item.get_closest_marker("beside_cluster") is not None


@pytest.hookimpl(tryfirst=True)       # before -m selects: `-m slurm` then means every test on the cluster
def pytest_collection_modifyitems(config, items):
    """Every test that uses the local cluster is marked slurm. TEST_PART=cluster keeps those and the ones marked
    beside_cluster, TEST_PART=rest the others: tests/run.sh runs the two halves side by side."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.slurm)
    part = os.environ.get("TEST_PART", "")
    if not part:
        return
    if part not in PARTS:
        raise pytest.UsageError(f"TEST_PART={part!r}: expected one of {', '.join(PARTS)} (or unset: every test)")
    keep = [i for i in items if in_cluster_half(i) == (part == "cluster")]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def cluster_running(where: Path | None) -> bool:
    pid = where / "slurmctld.pid" if where else None
    return bool(pid and pid.exists() and subprocess.run(["kill", "-0", pid.read_text().strip()]).returncode == 0)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local Slurm cluster (started here if not running, stopped at the end if we started it)."""
    from hpc.slurm_info import local_cluster_dir
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip("Slurm is not installed (run `make slurm-install`, or `make test` which does it)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (mknod, /etc/hosts)")
    running = cluster_running(local_cluster_dir())
    if not running:
        subprocess.run(["bash", str(REPO / "hpc/cluster/start.sh")], check=True, timeout=180)
    where = local_cluster_dir()
    env = dict(os.environ, HPC_CLUSTER_DIR=str(where))
    yield where / "slurm.conf"
    if not running:
        subprocess.run(["bash", str(REPO / "hpc/cluster/stop.sh")], env=env, timeout=120)


# The test cluster's nodes are one machine's two cores, shared with the rest of the suite: a host of a job that is
# not about slowness was found at 0.39x and 0.45x for seconds on end (CI, 2026-11-29), so its jobs judge as a site
# whose nodes are shared would (TRAINER_PREFLIGHT_SLOW); a slowed node (test_slow_node.py) is 0.05x, a slowed
# link (test_slow_link.py) 0.1x or less: both still named.
SHARED_NODES_SLOW = "0.2"


def slurm_env(conf: Path, **extra: str) -> dict[str, str]:
    """Clean environment pointed at the test cluster."""
    return clean_env(SLURM_CONF=str(conf), TRAINER_PREFLIGHT_SLOW=SHARED_NODES_SLOW, **extra)


def eval_one_and_three(ckpt: Path | str, out: Path, *overrides: str) -> tuple[dict, dict]:
    """`trainer eval` of a checkpoint in one process and sharded over 3 ranks: the two metric reports."""
    import json
    trainer("eval", "--checkpoint", str(ckpt), "--out", str(out / "one.json"), *overrides)
    run_ranks(3, "eval", "--checkpoint", str(ckpt), "--out", str(out / "three.json"), *overrides)
    return tuple(json.loads((out / f).read_text()) for f in ("one.json", "three.json"))


def train_until_sigterm(module: str, cls: str, kill_at: int, args: tuple[str, ...], run_dir: Path,
                        timeout: float = 300) -> subprocess.CompletedProcess:
    """`trainer` ARGS --run-dir RUN_DIR that sends itself SIGTERM at the kill_at-th training_step call."""
    code = (f"import os,signal,sys,{module} as r;orig=r.{cls}.training_step;n=[0]\n"
            f"def step(self,m,b):\n n[0]+=1\n if n[0]=={kill_at}: os.kill(os.getpid(),signal.SIGTERM)\n"
            " return orig(self,m,b)\n"
            f"r.{cls}.training_step=step\nfrom trainer.cli import main;sys.exit(main(sys.argv[1:]))")
    return subprocess.run([PY, "-c", code, *args, "--run-dir", str(run_dir)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)

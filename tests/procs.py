"""Processes of the tests: the trainer as a real subprocess (trainer), ranks launched as torchrun would start them
(launch_ranks, run_ranks, wait_all: a hung rank is stopped with its stacks), a clean environment (clean_env), the
checkpoints' weights compared (weights, assert_bitwise_equal, assert_close) and the fault tests' figures
(record_fault). A test whose process is not what it checks runs the command line in process instead
(tests/inprocess.py cli)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.locks import free_port  # noqa: F401 (the tests import it from here)
from tests.timeouts import limit

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


def trainer(*args: str, env: dict | None = None, timeout: float = limit("runs"), check: bool = True):
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


def wait_all(procs: list[subprocess.Popen], timeout: float = limit("runs")) -> list[tuple[int, str]]:
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
            _, err = p.communicate(timeout=limit("short"))
        except subprocess.TimeoutExpired:
            _signal_all(trees.get(p.pid, [p.pid]), signal.SIGKILL)
            try:
                _, err = p.communicate(timeout=limit("short"))
            except subprocess.TimeoutExpired:
                err = "(no stderr: its pipe is held open by a process outside its tree)"
        tails.append(f"--- rank {rank} (exit {p.returncode}) ---\n{(err or '')[-20000:]}")   # its workers too
    return "\n".join(tails)


def run_group(argv: list[str], env: dict, timeout: float = limit("long")) -> tuple[int, str]:
    """(returncode, stderr) of ARGV (a launcher and everything it starts); a hang past timeout seconds fails
    the test with the stacks of every process it started."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return wait_all([proc], timeout)[0]


def run_ranks(n: int, *args: str, timeout: float = limit("runs"),
              extra_env: dict | None = None) -> list[tuple[int, str]]:
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


def eval_one_and_three(ckpt: Path | str, out: Path, *overrides: str) -> tuple[dict, dict]:
    """`trainer eval` of a checkpoint in one process and sharded over 3 ranks: the two metric reports."""
    import json
    trainer("eval", "--checkpoint", str(ckpt), "--out", str(out / "one.json"), *overrides)
    run_ranks(3, "eval", "--checkpoint", str(ckpt), "--out", str(out / "three.json"), *overrides)
    return tuple(json.loads((out / f).read_text()) for f in ("one.json", "three.json"))


def train_until_sigterm(module: str, cls: str, kill_at: int, args: tuple[str, ...], run_dir: Path,
                        timeout: float = limit("long")) -> subprocess.CompletedProcess:
    """`trainer` ARGS --run-dir RUN_DIR that sends itself SIGTERM at the kill_at-th training_step call."""
    code = (f"import os,signal,sys,{module} as r;orig=r.{cls}.training_step;n=[0]\n"
            f"def step(self,m,b):\n n[0]+=1\n if n[0]=={kill_at}: os.kill(os.getpid(),signal.SIGTERM)\n"
            " return orig(self,m,b)\n"
            f"r.{cls}.training_step=step\nfrom trainer.cli import main;sys.exit(main(sys.argv[1:]))")
    return subprocess.run([PY, "-c", code, *args, "--run-dir", str(run_dir)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)

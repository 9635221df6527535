"""Many jobs on one parsed-data cache, on the real local Slurm cluster: job arrays on both nodes started at once,
three parse settings, and a second wave after the data file changed while tasks of the first still run. Every
task completes; each (data, settings) pair is parsed once; no task waits longer than the build plus 10 s; the
cache at its cap removes only the entry no job leases. (The killed builders and a dead node's lock:
tests/unit/test_cache_many_jobs.py.)"""
from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PY, slurm_env
from tests.slurm.test_cluster import sbatch, wait_job
from tests.timeouts import limit

pytestmark = pytest.mark.slurm
SETTINGS = 3            # kcore = task id % 3: three parse settings


def write_data(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(1, 20001), 15)
    items = rng.integers(1, 3000, len(users))
    lines = [f"{u}\t{i}\t5\t{t}\n" for t, (u, i) in enumerate(zip(users, items))]
    path.write_text("".join(lines))
    return path


def wave(conf, out: Path, name: str, root: Path, data: Path, *, tasks: int, hold: str, cap_gb: float,
         kcore: str = f"$((SLURM_ARRAY_TASK_ID % {SETTINGS}))") -> str:
    """An array of `tasks` tasks, each mapping (or building) the entry of setting task % 3, then holding it."""
    user = " ".join(shlex.quote(a) for a in (PY, "-m", "tests.cache_user", "--root", str(root), "--data", str(data),
                                              "--cap-gb", str(cap_gb)))
    script = f'{user} --kcore {kcore} --hold {hold}'
    return sbatch(conf, script, f"--array=0-{tasks - 1}", "-n1", "-c1", f"--output={out}/{name}-%a.out",
                  f"--error={out}/{name}-%a.err")


def results(out: Path, name: str, tasks: int) -> list[dict]:
    got = []
    for a in range(tasks):
        lines = (out / f"{name}-{a}.out").read_text().strip().splitlines()
        assert lines, (out / f"{name}-{a}.err").read_text()[-2000:]
        got.append(json.loads(lines[-1]))
        assert "error" not in got[-1], got[-1]
    return got


def loaded(out: Path, name: str, tasks: int) -> bool:
    return all((out / f"{name}-{a}.out").exists() and (out / f"{name}-{a}.out").read_text().strip()
               for a in range(tasks))


def test_job_arrays_on_both_nodes_share_one_cache(slurm_cluster, tmp_path):
    root, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    data = write_data(tmp_path / "u.data", seed=0)
    # an entry of a fourth setting that no job maps any more: the only one the cap may take
    old = wave(slurm_cluster, out, "old", root, data, tasks=1, hold="0", cap_gb=20, kcore=str(SETTINGS))
    assert wait_job(slurm_cluster, old, timeout=limit("long"))["JobState"] == "COMPLETED"
    leaseless = results(out, "old", 1)[0]["entry"]
    # wave 1: six tasks at once; tasks 0 and 1 keep their entries mapped while wave 2 runs, the rest end
    first = wave(slurm_cluster, out, "w1", root, data, tasks=6, hold="$(( SLURM_ARRAY_TASK_ID < 2 ? 60 : 0 ))",
                 cap_gb=20)
    deadline = time.monotonic() + limit("long")
    while not loaded(out, "w1", 6):
        assert time.monotonic() < deadline, "wave 1 never loaded"
        time.sleep(0.5)
    write_data(data, seed=1)                              # the data changes while wave 1 still runs
    # wave 2 at a cap of ~0: each build removes every entry no job maps; its own tasks map theirs for 15 s
    second = wave(slurm_cluster, out, "w2", root, data, tasks=6, hold="15", cap_gb=1e-9)
    for job in [f"{first}_{a}" for a in range(2, 6)] + [f"{second}_{a}" for a in range(6)]:
        assert wait_job(slurm_cluster, job, timeout=limit("long"))["JobState"] == "COMPLETED", job
    w1, w2 = results(out, "w1", 6), results(out, "w2", 6)
    for got in (w1, w2):
        entries = [g["entry"] for g in got]
        assert len(set(entries)) == SETTINGS
        assert Counter(g["entry"] for g in got if g["built"]) == Counter(set(entries))     # each parsed once
        assert all(g["seconds"] <= g["built_s"] + 10 for g in got), got
    assert {g["node"] for g in w1 + w2} == {"node1", "node2"}
    assert not set(g["entry"] for g in w1) & set(g["entry"] for g in w2)           # the changed data: new entries
    cached = {p.name for p in root.iterdir() if not p.name.startswith(".")}
    assert leaseless not in cached                                 # the cap took the entry no job mapped
    assert {w1[0]["entry"], w1[1]["entry"]} <= cached              # and none that wave 1 still held
    for a in (0, 1):
        assert wait_job(slurm_cluster, f"{first}_{a}", timeout=limit("long"))["JobState"] == "COMPLETED"


@pytest.mark.timing
def test_a_builder_killed_on_one_node_is_taken_over_from_the_other_within_10_s(slurm_cluster, tmp_path):
    """The waiter is on another node: it cannot look the builder's pid up, and learns of its death from the lock's
    stale heartbeat."""
    root, pid_file, out = tmp_path / "cache", tmp_path / "b.pid", tmp_path / "out"
    out.mkdir()
    user = " ".join(shlex.quote(a) for a in (PY, "-m", "tests.cache_user", "--root", str(root), "--slow", "60",
                                              "--pid-file", str(pid_file)))
    builder = sbatch(slurm_cluster, user, "-w", "node1", "-n1", f"--output={out}/b.out", f"--error={out}/b.err")
    deadline = time.monotonic() + limit("run")
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, (out / "b.err").read_text()[-2000:] if (out / "b.err").exists() else ""
        time.sleep(0.2)
    waiter = sbatch(slurm_cluster, user, "-w", "node2", "-n1", f"--output={out}/w.out", f"--error={out}/w.err")
    while "waiting for pid" not in ((out / "w.err").read_text() if (out / "w.err").exists() else ""):
        assert time.monotonic() < deadline, "the waiter never waited"
        time.sleep(0.2)
    assert "on node1" in (out / "w.err").read_text()
    subprocess.run(["scancel", "--signal=KILL", "--full", builder], env=slurm_env(slurm_cluster), check=True)
    killed = time.time()
    assert wait_job(slurm_cluster, waiter, timeout=limit("run"))["JobState"] == "COMPLETED", (out / "w.err").read_text()
    got = json.loads((out / "w.out").read_text().strip().splitlines()[-1])
    log = (out / "w.err").read_text()
    assert got["done_at"] - killed < 10, (got, log[-2000:])
    assert "has not been heard of" in log and "taken over" in log and "parsing the data" in log

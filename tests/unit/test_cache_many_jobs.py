"""Many processes, jobs and nodes on one parsed-data cache (trainer/data/cache.py, trainer/data/owners.py), with
real processes: one build across jobs, a builder killed with SIGKILL (in-process: taken over; as a child: its
launch stops, the next launch builds) learnt of within 10 s, a dead node's lock taken over by its stale heartbeat.
The job arrays on both nodes of the local Slurm cluster are in tests/slurm/test_cache_arrays.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.timeouts import limit
from trainer.data import cache, owners

KEY = dict(source="slow", seconds=30.0)


def user(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.cache_user", "--root", str(root), *args], cwd=REPO,
                            env=clean_env(**(env or {})), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc: subprocess.Popen, timeout: float = limit("minute")) -> tuple[dict, str, float]:
    out, err = proc.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1]), err, time.monotonic()


def wait_for(path: Path, timeout: float = limit("short")) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def said_before(proc: subprocess.Popen, words: str, timeout: float = limit("minute")) -> str:
    """The process's stderr up to its first line with `words` (the rest is left for communicate())."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter_until(proc.stderr, words)), daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"{words!r} not said in {timeout:.0f} s: {''.join(lines)[-2000:]}"
    return "".join(lines)


def iter_until(stream, words: str):
    for line in stream:
        yield line
        if words in line:
            return


def test_two_jobs_at_once_build_once_and_the_waiter_names_the_builder(tmp_path, monkeypatch):
    """The builder's parse lasts until the waiter has said whom it waits for (a timed build lost that race on a
    loaded machine: the second job started after the build was done)."""
    root, release = tmp_path / "cache", tmp_path / "release"
    first = user(root, "--slow", "1", "--pid-file", str(tmp_path / "b.pid"), "--release", str(release),
                 env=dict(SLURM_JOB_ID="101"))
    wait_for(tmp_path / "b.pid")
    second = user(root, "--slow", "1", "--pid-file", str(tmp_path / "c.pid"), env=dict(SLURM_JOB_ID="102"))
    waited = said_before(second, "waiting for ")
    release.write_text("")
    (a, a_log, _), (b, b_log, _) = result(first), result(second)
    b_log = waited + b_log
    assert a["entry"] == b["entry"] and "parsing the data" in a_log and "parsing the data" not in b_log
    assert f"waiting for pid {first.pid} on " in b_log and ", job 101 to parse" in b_log
    assert not (tmp_path / "c.pid").exists()                 # the second job never built


@pytest.mark.timing
def test_a_builder_killed_in_process_is_taken_over_within_10_s(tmp_path):
    root, pid_file = tmp_path / "cache", tmp_path / "b.pid"
    builder = user(root, "--slow", "30", "--pid-file", str(pid_file))
    wait_for(pid_file)
    waiter = user(root, "--slow", "30", "--pid-file", str(pid_file), "--local-rank", "1")
    time.sleep(1.0)
    killed = time.monotonic()
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    got, log, done = result(waiter)
    assert "error" not in got and done - killed < 10, (done - killed, log)
    assert "taken over" in log and "is gone" in log
    assert int(pid_file.read_text()) == waiter.pid                  # the waiter built it
    assert not list(root.glob(".*.tmp")) and not list(root.glob(".*.lock"))


@pytest.mark.timing
def test_a_killed_build_child_stops_its_launch_within_10_s_and_the_next_launch_builds(tmp_path):
    root, pid_file = tmp_path / "cache", tmp_path / "child.pid"
    builder = user(root, "--slow", "30", "--pid-file", str(pid_file), "--child")
    child = wait_for(pid_file)
    waiter = user(root, "--slow", "30", "--pid-file", str(pid_file), "--local-rank", "1")
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(child, signal.SIGKILL)                           # the OOM killer's way
    (b, _, _), (w, _, done) = result(builder), result(waiter)
    assert "exited -9 (killed: out of memory?)" in b["error"]
    assert "build failed on local rank 0" in w["error"] and "exited -9" in w["error"] and done - killed < 10
    assert (root / f".{cache.entry_name('slow', KEY)}.failed").exists()
    again, log, _ = result(user(root, "--slow", "30", "--pid-file", str(pid_file), "--child"))
    assert "error" not in again and "parsing the data" in log          # a later launch tries again
    assert not (root / f".{cache.entry_name('slow', KEY)}.failed").exists()


@pytest.mark.timing
def test_a_lock_of_another_node_is_taken_over_once_its_heartbeat_is_stale(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    lock = root / f".{cache.entry_name('slow', dict(source='slow', seconds=0.5))}.lock"
    dead = owners.Owner("node9", "elsewhere", 4242, "77", "x", time.time(), "feedbeef")
    lock.write_text(json.dumps(dead.__dict__))
    proc = user(root, "--slow", "0.5")
    # the other node's heartbeat goes on until this job is waiting for it: a start slower than STALE_S (2 busy cores
    # of CI) would otherwise find the lock stale at once, and the stale time is counted from the last beat
    lines: list[str] = []
    waiting = threading.Event()

    def read_log() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "waiting for pid 4242 on node9, job 77" in line:
                waiting.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    deadline = time.monotonic() + limit("minute")
    while not waiting.is_set():
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        os.utime(lock)
        last_beat = time.monotonic()
        waiting.wait(0.2)
    got = json.loads(proc.stdout.read().strip().splitlines()[-1])
    proc.wait(timeout=limit("minute"))
    done = time.monotonic()
    reader.join(timeout=limit("brief"))
    log = "".join(lines)
    assert "error" not in got
    assert owners.STALE_S - 1 < done - last_beat < owners.STALE_S + 10 and "has not been heard of" in log
    assert "taken over" in log

"""A run that finds a C++ extension missing goes on at once on its fallback and builds it behind itself
(trainer/native/background.py): one builder per extensions cache, a failure recorded so that later runs say why
instead of compiling again, TRAINER_NATIVE_BUILD=off|wait. The builders here have no compiler (CXX points nowhere),
so they fail in seconds; the real build behind a real run is bench/first_run.py's (README's set-up figures)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.timeouts import limit
from trainer.native import background

LOAD = ("from trainer.recipes import kernels\n"
        "print('OPS', kernels.load())\n"
        "print('WHY', kernels.unavailable_reason())\n")


def run_load(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    e = clean_env(TRAINER_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(tmp_path / "no-such-compiler"),
                  PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=limit("run"))


def wait_unlocked(root: Path, timeout: float = limit("run")) -> None:
    deadline = time.monotonic() + timeout
    while (root / background.LOCK).exists():
        assert time.monotonic() < deadline, f"the builder still holds {root / background.LOCK}"
        time.sleep(0.2)


def test_a_missing_build_starts_one_builder_and_a_failed_one_is_not_retried_by_runs(tmp_path):
    root = tmp_path / "ext"
    first = run_load(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "OPS None" in first.stdout                       # the run went on, on the PyTorch path
    assert "fused CPU kernels: not built for this CPU type yet: building it in the background now (pid" in first.stderr
    assert "this run uses the PyTorch path" in first.stderr and "building fused CPU kernels" not in first.stderr
    wait_unlocked(root)
    log = (root / background.LOG).read_text()
    assert "building behind a run" in log and "fused CPU kernels: cannot build" in log
    assert log.index("building fused CPU kernels") < log.index("building the shared-memory all-reduce")  # its own first
    failed = sorted(p.parent.name for p in root.glob(f"*/{background.FAILED}"))
    assert len(failed) == 3, failed                         # every extension's, each in its own build key's folder
    again = run_load(tmp_path)
    assert "OPS None" in again.stdout and "its last build failed" in again.stderr
    assert "`python -m trainer.native build` retries" in again.stderr
    assert not (root / background.LOCK).exists() and log == (root / background.LOG).read_text()   # no new builder


def test_a_live_builder_is_joined_and_a_dead_ones_lock_is_taken_over(tmp_path):
    root = tmp_path / "ext"
    root.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (root / background.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid,
                                                        "start": time.time()}))
        joined = run_load(tmp_path)
        assert f"being built in the background (pid {sleeper.pid} on {socket.gethostname()}" in joined.stderr
        assert not (root / background.LOG).exists()        # nothing started
    finally:
        sleeper.kill()
        sleeper.wait()
    took = run_load(tmp_path)                               # the holder is gone: its lock is stale
    assert "building it in the background now" in took.stderr
    wait_unlocked(root)
    assert "building behind a run" in (root / background.LOG).read_text()


def test_a_lock_from_another_host_is_held_until_stale(tmp_path):
    root = tmp_path / "ext"
    root.mkdir()
    lock = root / background.LOCK
    lock.write_text(json.dumps({"host": "another-node", "pid": 1, "start": time.time()}))
    assert background.holder(root)["host"] == "another-node"         # a shared home: its pid cannot be checked here
    old = time.time() - background.STALE_S - 5
    os.utime(lock, (old, old))
    assert background.holder(root) is None


def test_off_starts_nothing_and_wait_builds_in_the_run(tmp_path):
    off = run_load(tmp_path, TRAINER_NATIVE_BUILD="off")
    assert "OPS None" in off.stdout and "TRAINER_NATIVE_BUILD=off" in off.stderr and "`make kernels`" in off.stderr
    assert not (tmp_path / "ext" / background.LOCK).exists() and not (tmp_path / "ext" / background.LOG).exists()
    wait = run_load(tmp_path, TRAINER_NATIVE_BUILD="wait")
    assert "building fused CPU kernels (native), once per CPU type" in wait.stderr     # in the run itself
    assert "OPS None" in wait.stdout and not (tmp_path / "ext" / background.LOG).exists()
    bad = run_load(tmp_path, TRAINER_NATIVE_BUILD="later")
    assert "OPS None" in bad.stdout and "TRAINER_NATIVE_BUILD='later': expected one of background, wait, off" in \
        bad.stdout + bad.stderr


@pytest.fixture
def ticking(monkeypatch):
    """scripts/ticking.py (not a package: make setup runs it with the system's python3), ticking every 0.2 s."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import ticking
    monkeypatch.setattr(ticking, "TICK_S", 0.2)
    return ticking


def test_ticking_says_every_ten_seconds_that_pip_still_runs(tmp_path, ticking):
    assert ticking.main(["label", "--", sys.executable, "-c", "import time; time.sleep(1.1)"]) == 0
    assert ticking.main(["label", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert ticking.main(["label", "--", str(tmp_path / "no-such-pip")]) == 127
    assert ticking.main(["label", "no separator"]) == 2


def test_ticking_output(capfd, ticking):
    ticking.main(["make setup: installing torch (pip)", "--", sys.executable, "-c", "import time; time.sleep(1.1)"])
    out = capfd.readouterr().out.splitlines()
    assert out[0] == "make setup: installing torch (pip) ..."
    ticks = [line for line in out if line.endswith(" s ...")]
    assert len(ticks) >= 3, out                     # 0.2 s ticks over 1.1 s
    assert out[-1].startswith("make setup: installing torch (pip): done in")


@pytest.mark.parametrize("mode", ["", "background"])
def test_the_default_mode_is_background(monkeypatch, mode):
    monkeypatch.setenv(background.MODE_ENV, mode)
    assert background.build_mode() == "background"

"""The C++ extensions built behind a run instead of before it: a run that finds one missing starts one builder
process for every missing extension (niced, one compiler at a time, the one it needs first first) and goes on at
once on that extension's PyTorch fallback; later runs load the builds. TRAINER_NATIVE_BUILD picks how:
background (the default), wait (build in the run before going on: the old way, a minute or more per extension) or
off (never build in a run: `python -m trainer.native build` / `make kernels` only).

    how = build_mode()                                  # "background" | "wait" | "off"
    line = start_or_join("trainer_cpu_kernels")         # what the run should say: builder started, or running
    failed = last_failure(key_dir)                      # why the last background build of this key failed, or None

One builder at a time per extensions cache: a lock file (cache_root()/.building: host, pid, start) taken with
O_EXCL; a holder that died (its pid gone on this host) or is older than STALE_S (another host of a shared home)
is taken over. The builder writes its log to cache_root()/build.log, and a failed build leaves `failed` beside
its build key's folder so that runs say why instead of starting a compiler that fails again; `python -m
trainer.native build` in the foreground clears it and retries.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

MODES = ("background", "wait", "off")
MODE_ENV = "TRAINER_NATIVE_BUILD"
STALE_S = 30 * 60          # a lock older than this is taken over (its holder on another host cannot be checked)
YOUNG_S = 30.0             # a lock being written (no pid yet) is held this long
LOCK, LOG, FAILED = ".building", "build.log", "failed"


def build_mode() -> str:
    mode = os.environ.get(MODE_ENV, "background").strip().lower() or "background"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder(root: Path) -> dict | None:
    """The running builder's lock record ({host, pid, start}), or None where none holds the lock (or it is stale)."""
    lock = root / LOCK
    try:
        text, age = lock.read_text(), time.time() - lock.stat().st_mtime
    except OSError:
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return {"host": "", "pid": 0, "start": 0} if age < YOUNG_S else None     # being written
    if age > STALE_S:
        return None
    if rec.get("host") == socket.gethostname() and not _alive(int(rec.get("pid", 0))):
        return None
    return rec


def _take_lock(root: Path) -> int | None:
    """The lock's file descriptor, or None where a live builder holds it. A stale lock is removed first."""
    root.mkdir(parents=True, exist_ok=True)
    lock = root / LOCK
    if lock.exists() and holder(root) is None:
        lock.unlink(missing_ok=True)
    try:
        return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None


def start_or_join(first: str, root: Path) -> str:
    """Start the builder (the extension named `first` built first) unless one runs; what the run should say."""
    fd = _take_lock(root)
    if fd is None:
        rec = holder(root) or {}
        who = f"pid {rec['pid']} on {rec['host']}" if rec.get("pid") else "its builder starting"
        return f"being built in the background ({who}, log {root / LOG})"
    log = open(root / LOG, "ab")                 # noqa: SIM115 - handed to the builder, closed here after
    try:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.native", "build", "--background", first],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)       # outlives the run that started it (torchrun, a demo)
    except OSError as err:
        os.close(fd)
        (root / LOCK).unlink(missing_ok=True)
        return f"not built, and no builder could start ({err})"
    finally:
        log.close()
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": proc.pid, "start": time.time()}).encode())
    os.close(fd)
    took = last_build_s(root)
    when = f"; the last build of them here took {took:.0f} s" if took else ""
    return f"building it in the background now (pid {proc.pid}{when}, log {root / LOG})"


TIMES = "build-times.json"      # {extension-kind: seconds} of the last builds on this cache: the estimate a run says


def record_build(root: Path, name: str, seconds: float) -> None:
    """Note how long `name` took to build here (a file written under a private name, then renamed)."""
    times = _times(root)
    times[name] = round(seconds, 1)
    tmp = root / f".{TIMES}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(times, sort_keys=True) + "\n")
        os.replace(tmp, root / TIMES)
    except OSError:
        tmp.unlink(missing_ok=True)


def _times(root: Path) -> dict[str, float]:
    try:
        found = json.loads((root / TIMES).read_text())
        return {k: float(v) for k, v in found.items()} if isinstance(found, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def last_build_s(root: Path, names: list[str] | None = None) -> float | None:
    """Seconds the last builds of `names` (default: every native build recorded) took on this cache; None where one
    was never measured here (then a message names no number)."""
    times = _times(root)
    names = names if names is not None else [k for k in times if k.endswith("-native")]
    return sum(times[n] for n in names) if names and all(n in times for n in names) else None


def release(root: Path) -> None:
    """The builder's last act: the lock goes, whether its builds succeeded or not."""
    (root / LOCK).unlink(missing_ok=True)


def record_failure(key_dir: Path, why: str) -> None:
    key_dir.mkdir(parents=True, exist_ok=True)
    (key_dir / FAILED).write_text(why.strip() + "\n")


def last_failure(key_dir: Path) -> str | None:
    try:
        return (key_dir / FAILED).read_text().strip() or "unknown"
    except OSError:
        return None


def clear_failure(key_dir: Path) -> None:
    (key_dir / FAILED).unlink(missing_ok=True)

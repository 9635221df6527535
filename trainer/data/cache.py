"""The parsed-data cache (`data.cache`): a dataset's flat arrays parsed once, written as .npy files, and
memory-mapped by every rank of every later launch; one rank per node builds, the others wait for it.

    arrays, meta = load_or_build(root, "sasrec", key, "trainer.recipes.sasrec.sequences:build_flat", (cfg,),
                                 local_rank=info.local_rank)
    arrays["items"]          # np.memmap, read-only: the page cache holds it once for all ranks of a node

ROOT/<name>-<hash of key>/ holds one .npy per array and manifest.json (the key, each array's shape and dtype,
the builder's meta, when it was built and in how many seconds). The key names the data's fingerprint
(trainer/data/fingerprint.py) and every setting the parse depends on, so other data or settings land in another
entry and an entry is never reused for data it was not built from.

Many jobs on many nodes share one cache (trainer/data/owners.py): an entry is built once across all of them, by
the first local rank 0 to take its lock (ROOT/.<entry>.lock); the rest wait, and a waiter takes the lock over from
a builder that died (its pid gone on its node, or its heartbeat stale) within 10 s. A build that failed stops the
waiters of its own launch; the next launch tries again, once. Every process that maps an entry holds a lease on it
(ROOT/.leases/<entry>/) while it lives: nothing removes a leased entry. Past data.cache_cap_gb, the least recently
used entries without a live lease are removed after a build (`python -m trainer data cache` lists and clears).
An entry is built in a temporary folder named by its builder and renamed into place (no file locks: flock does not
reach across NFS clients). The engine builds the data before it tells malloc to keep freed memory
(trainer/native/memory.py), so a parse's temporaries go back to the system; in a process whose malloc keeps them
already (a second run in one process, a bench), a large build runs in a child process instead, so they never stay
resident in the training process.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import owners
from trainer.data.fingerprint import fingerprints
from trainer.launch.exitcodes import disk_error
from trainer.native import memory

log = logging.getLogger(__name__)
FORMAT = 1                 # of the cache's layout; part of every key
POLL_S, REPORT_S = 0.5, 15.0
DEFAULT_CAP_GB = 20.0     # data.cache_cap_gb: past it, the least recently used entries without a live lease go
LEASES = ".leases"         # ROOT/.leases/<entry>/<node>.<pid>.<token>.lease: who maps the entry now
CHILD_FROM = 64 << 20      # data files of this many bytes together: parsed in a child where malloc keeps freed memory


class CacheError(ValueError):
    """The cache cannot be used as configured (e.g. its folder cannot be written), or the build failed."""


def default_root() -> Path:
    """TRAINER_DATA_CACHE, else ~/.cache/hpc-trainer/data (beside the built kernels)."""
    return Path(os.environ.get("TRAINER_DATA_CACHE") or Path.home() / ".cache" / "hpc-trainer" / "data")


def root_of(setting: str) -> Path | None:
    """data.cache: "" the default root, "off" no cache, else that folder."""
    if setting == "off":
        return None
    return Path(setting).expanduser() if setting else default_root()


def entry_name(name: str, key: dict) -> str:
    text = json.dumps(dict(key, cache_format=FORMAT), sort_keys=True)
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def load(folder: Path, key: dict) -> tuple[dict[str, np.ndarray], dict] | None:
    """The entry's arrays (memory-mapped) and meta, or None where it is missing, of another key, or damaged."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("key") != json.loads(json.dumps(key)) or manifest.get("format") != FORMAT:
        return None
    arrays = {}
    for name, spec in manifest.get("arrays", {}).items():
        try:
            arr = np.load(folder / f"{name}.npy", mmap_mode="r")
        except (OSError, ValueError):
            return None                                   # missing or truncated
        if list(arr.shape) != spec["shape"] or str(arr.dtype) != spec["dtype"]:
            return None
        arrays[name] = arr
    return arrays, manifest.get("meta", {})


class _Warnings(logging.Handler):
    """The warnings a build logs (dropped duplicates, ...): kept in the manifest, said again at every load."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _build_into(tmp: Path, builder: str, args: tuple) -> tuple[dict, dict, float]:
    """Run builder(*args) -> (arrays, meta) and write them into tmp (the manifest last: it marks them whole)."""
    module, func = builder.split(":")
    start = time.perf_counter()
    caught = _Warnings()
    logging.getLogger("trainer").addHandler(caught)
    try:
        arrays, meta = getattr(importlib.import_module(module), func)(*args)
    finally:
        logging.getLogger("trainer").removeHandler(caught)
    meta = dict(meta, warnings=caught.messages)
    specs = {}
    try:
        tmp.mkdir(parents=True)
        for name, arr in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(arr))
            specs[name] = dict(shape=list(arr.shape), dtype=str(arr.dtype))
    except (OSError, ValueError) as err:     # numpy's own OSError on a full disk carries no errno
        raise _WriteFailed(tmp, err) from None
    return specs, meta, round(time.perf_counter() - start, 3)


class _WriteFailed(Exception):
    """A build's arrays could not be written (the cause, with the folder)."""

    def __init__(self, path: Path, cause: BaseException):
        super().__init__(str(cause))
        self.path, self.cause = path, cause


def _child(tmp: Path, builder: str, args: tuple, key: dict) -> None:
    """A child process's build; its error is written beside tmp for the parent to raise."""
    try:
        specs, meta, seconds = _build_into(tmp, builder, args)
        _write_manifest(tmp, key, specs, dict(meta, child_peak_rss_mb=_peak_rss_mb()), seconds)
    except Exception as err:                                # noqa: BLE001 - handed to the parent whole
        tmp.with_suffix(".error").write_text(json.dumps(dict(type=type(err).__name__, message=str(err))))
        raise SystemExit(1) from None


def _peak_rss_mb() -> float | None:
    """This process's peak RSS (VmHWM), where /proc has it."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _write_manifest(folder: Path, key: dict, specs: dict, meta: dict, seconds: float) -> None:
    manifest = dict(format=FORMAT, key=key, arrays=specs, meta=meta, built_s=seconds, host=socket.gethostname(),
                    created=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except OSError as err:
        raise _WriteFailed(folder / "manifest.json", err) from None


# ------------------------------------------------------------------------------ one build across jobs

def _lock_path(root: Path, entry: str) -> Path:
    return root / f".{entry}.lock"


def _failed_marker(root: Path, entry: str) -> Path:
    return root / f".{entry}.failed"


def _failure(root: Path, entry: str) -> str | None:
    """The error of a build that failed in this launch, after this process started (final for it); a marker of an
    earlier launch is not: this launch tries the build again, once."""
    try:
        marker = json.loads(_failed_marker(root, entry).read_text())
    except (OSError, ValueError):
        return None
    mine = owners.me()
    if not isinstance(marker, dict) or marker.get("launch") != mine.launch or marker.get("written", 0) < mine.started - 0.25:
        return None
    return str(marker.get("error"))


def _mark_failed(root: Path, entry: str, lock: owners.BuildLock, err: BaseException) -> None:
    if not lock.mine():               # taken over meanwhile: the new builder's waiters are not ours to stop
        return
    marker = _failed_marker(root, entry)
    tmp = owners.private_name(marker)
    try:
        tmp.write_text(json.dumps(dict(launch=owners.me().launch, written=time.time(), owner=str(owners.me()),
                                       error=f"{type(err).__name__}: {err}")))
        os.replace(tmp, marker)
    except OSError:
        tmp.unlink(missing_ok=True)


def _remove_partial(root: Path, entry: str) -> None:
    """The temporaries of builders that died mid-write (only the lock's holder builds: any other is a dead one's)."""
    for tmp in root.glob(f".{entry}.*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def build(root: Path, entry: str, key: dict, builder: str, args: tuple, in_child: bool, error: type,
          lock: owners.BuildLock) -> None:
    """Build the entry into a temporary folder and rename it into place (the caller holds the entry's lock)."""
    _remove_partial(root, entry)
    _failed_marker(root, entry).unlink(missing_ok=True)
    tmp = owners.private_name(root / entry)
    try:
        if in_child:
            proc = multiprocessing.get_context("spawn").Process(target=_child, args=(tmp, builder, args, key))
            proc.start()
            proc.join()
            failure = tmp.with_suffix(".error")
            if failure.exists():
                info = json.loads(failure.read_text())
                failure.unlink()
                if info["type"] == "_WriteFailed":
                    raise _WriteFailed(tmp, OSError(info["message"]))
                raise (error if info["type"] != "CacheError" else CacheError)(info["message"])
            if proc.exitcode != 0:
                killed = " (killed: out of memory?)" if proc.exitcode == -9 else ""
                raise CacheError(f"data.cache: the process building {root / entry} exited {proc.exitcode}{killed}")
        else:
            specs, meta, seconds = _build_into(tmp, builder, args)
            _write_manifest(tmp, key, specs, meta, seconds)
    except _WriteFailed as failed:           # the disk, not the data: exit 4, as any write the run must make
        err = disk_error(failed.path, failed.cause, "the data cache entry",
                         "free space under data.cache, or data.cache=DIR elsewhere, or data.cache=off")
        shutil.rmtree(tmp, ignore_errors=True)
        _mark_failed(root, entry, lock, err)
        raise err from None
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _mark_failed(root, entry, lock, err)
        raise
    target = root / entry
    if target.exists() and load(target, key) is None:     # damaged under this name: never trusted
        _discard(target)
    try:
        os.rename(tmp, target)
    except OSError:                              # a stalled builder's entry won the race: keep it
        shutil.rmtree(tmp, ignore_errors=True)


def _set_aside(folder: Path) -> Path | None:
    """An entry renamed to a private name, to be removed (one remover wins, no reader finds it half-deleted); None
    where another remover won."""
    trash = owners.private_name(folder.with_name("trash-" + folder.name))
    try:
        os.rename(folder, trash)
    except OSError:
        return None
    return trash


def _discard(folder: Path) -> None:
    """Remove an entry."""
    if (trash := _set_aside(folder)) is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _report(root: Path, entry: str, waited: float) -> None:
    holder = owners.holder_of(_lock_path(root, entry))
    who = f"{holder}" if holder else "local rank 0"
    log.info("waiting for %s to parse the data into %s (%.0f s)", who, root / entry, waited)


def obtain(root: Path, entry: str, key: dict, builder: str, args: tuple, local_rank: int, timeout_s: float,
           in_child: bool, error: type) -> tuple[dict, dict]:
    """The entry: loaded, or built once across every job and node by the first local rank 0 to take its lock; the
    others wait, and take the lock over from a builder that died. A build failed in this launch stops its waiters."""
    start = time.monotonic()
    last = start - REPORT_S                   # whom it waits for: said at once, then every REPORT_S
    lock_path = _lock_path(root, entry)
    while (got := load(root / entry, key)) is None:
        if (failed := _failure(root, entry)) is not None:
            raise error(f"the data cache's build failed on local rank 0: {failed}")
        # local rank 0 builds; a waiter builds only in a dead builder's place
        if (local_rank == 0 or lock_path.exists()) and (lock := owners.BuildLock.take(lock_path)) is not None:
            with lock:
                if load(root / entry, key) is None:
                    log.info("parsing the data into the cache %s (once: later launches map it)", root / entry)
                    build(root, entry, key, builder, args, in_child, error, lock)
                    log.info("data cache: %s built in %.1f s", root / entry, time.monotonic() - start)
            continue
        now = time.monotonic()
        if now - start > timeout_s:
            raise CacheError(f"data.cache: {root / entry} not built within {timeout_s:.0f} s "
                             f"(by {owners.holder_of(lock_path) or 'local rank 0'})")
        if now - last >= REPORT_S:
            _report(root, entry, now - start)
            last = now
        time.sleep(POLL_S)
    return got


# ------------------------------------------------------------------------------ the cap

def entry_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


@dataclass(frozen=True)
class Entry:
    """One entry of the cache as `data cache list` shows it."""

    path: Path
    bytes: int
    used: float                    # when a job last mapped it
    leases: tuple[owners.Owner, ...]


def entries_of(root: Path) -> list[Entry]:
    """The cache's entries, least recently used first (their live leases read, dead ones removed)."""
    out = []
    for folder in root.iterdir() if root.is_dir() else ():
        if folder.name.startswith(".") or not (folder / "manifest.json").is_file():
            continue
        try:
            out.append(Entry(folder, entry_bytes(folder), (folder / "manifest.json").stat().st_mtime,
                             tuple(owners.live_leases(root / LEASES / folder.name))))
        except OSError:
            continue
    return sorted(out, key=lambda e: e.used)


def evict(root: Path, cap_bytes: float, keep: str = "") -> list[Entry]:
    """Remove the least recently used entries without a live lease until the cache holds at most cap_bytes;
    what was removed. An entry leased while it is being removed is put back."""
    found = entries_of(root)
    total = sum(e.bytes for e in found)
    removed = []
    for e in found:
        if total <= cap_bytes:
            break
        if e.leases or e.path.name == keep:
            continue
        if (trash := _set_aside(e.path)) is None:
            continue
        if owners.live_leases(root / LEASES / e.path.name):        # leased in between: put back
            try:
                os.rename(trash, e.path)
            except OSError:
                pass
            continue
        shutil.rmtree(trash, ignore_errors=True)
        shutil.rmtree(root / LEASES / e.path.name, ignore_errors=True)
        total -= e.bytes
        removed.append(e)
        log.info("data cache: removed %s (%.1f MiB, last used %s; the cache is over its cap of %.1f GB)", e.path,
                 e.bytes / 2**20, time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.used)), cap_bytes / 1e9)
    return removed


def load_or_build(root: Path, name: str, key: dict[str, Any], builder: str, args: tuple, local_rank: int = 0,
                  timeout_s: float = 1800.0, in_child: bool = False, error: type = CacheError,
                  cap_gb: float = DEFAULT_CAP_GB):
    """(arrays, meta) of the entry for `key` under root: loaded, or built once (see obtain()). This process holds a
    lease on it for as long as it lives, so no other job removes it; after a build, evict_pending() removes the
    least recently used leaseless entries while the cache is over cap_gb. `error` is the exception type a failed build is raised as
    (the recipe's DataError)."""
    entry = entry_name(name, key)
    start = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise disk_error(root, err, "the data cache folder (data.cache): cannot create it",
                         "data.cache=DIR on a writable disk, or data.cache=off (every launch parses again)") from None
    owners.hold_lease(root / LEASES / entry)           # before the entry is mapped: never removed under us
    got = load(root / entry, key)
    if got is not None:
        log.info("data cache: %s memory-mapped in %.2f s", root / entry, time.perf_counter() - start)
        for message in got[1].get("warnings", []):
            log.warning("%s (said when the data was parsed into the cache)", message)
        _touch(root / entry)
        return got
    got = obtain(root, entry, key, builder, args, local_rank, timeout_s, in_child, error)
    _touch(root / entry)
    if local_rank == 0 and cap_gb > 0:
        _PENDING[root] = cap_gb       # removed by evict_pending(): once the run is not refused
    return got


_PENDING: dict[Path, float] = {}      # cache folders this process built into, with their caps


def evict_pending() -> None:
    """Bring the caches this process built into under their caps (the engine calls it once nothing refused the run:
    a refused run removes nothing from the cache)."""
    while _PENDING:
        root, cap_gb = _PENDING.popitem()
        evict(root, cap_gb * 1e9)


def _touch(folder: Path) -> None:
    """When the entry was last used: its manifest's mtime (the cap removes the least recently used first)."""
    try:
        os.utime(folder / "manifest.json")
    except OSError:
        pass                                            # a read-only cache


def load_or_build_files(root: Path, name: str, source: Path, files: list[Path], settings: dict[str, Any],
                        builder: str, args: tuple, local_rank: int = 0, error: type = CacheError,
                        cap_gb: float = DEFAULT_CAP_GB):
    """load_or_build for data read from files: the key is the files' fingerprint (remembered under
    ROOT/fingerprints) and the parse's settings; files of CHILD_FROM bytes or more together are parsed in a child
    process where this process's malloc keeps freed memory."""
    key = dict(source=str(source), sha256=fingerprints(files, root / "fingerprints"), **settings)
    return load_or_build(root, name, key, builder, args, local_rank, error=error, cap_gb=cap_gb,
                         in_child=sum(f.stat().st_size for f in files) >= CHILD_FROM and memory.keeps_freed_memory())

"""The parsed-data cache (`data.cache`): a dataset's flat arrays parsed once, written as .npy files, and
memory-mapped by every rank of every later launch; one rank per node builds, the others wait for it.

    arrays, meta = load_or_build(root, "sasrec", key, "trainer.recipes.sasrec.sequences:build_flat", (cfg,),
                                 local_rank=info.local_rank)
    arrays["items"]          # np.memmap, read-only: the page cache holds it once for all ranks of a node

ROOT/<name>-<hash of key>/ holds one .npy per array and manifest.json (the key, each array's shape and dtype,
the builder's meta, when it was built and in how many seconds). The key names the data's fingerprint
(trainer/data/fingerprint.py) and every setting the parse depends on, so other data or settings land in another
entry and an entry is never reused for data it was not built from; entries of the same source with an older
key are removed once the new one is in place. An entry is built in a temporary folder and renamed into place
(no file locks: they are unreliable on NFS and Lustre home directories); a node that loses the race keeps the
winner's. The engine builds the data before it tells malloc to keep freed memory (trainer/native/memory.py), so a parse's
temporaries go back to the system; in a process whose malloc keeps them already (a second run in one process, a
bench), a large build runs in a child process instead, so they never stay resident in the training process.
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
from pathlib import Path
from typing import Any

import numpy as np

from trainer.native import memory
from trainer.data.fingerprint import fingerprints

log = logging.getLogger(__name__)
FORMAT = 1                 # of the cache's layout; part of every key
POLL_S, REPORT_S = 0.5, 15.0
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
    tmp.mkdir(parents=True)
    specs = {}
    for name, arr in arrays.items():
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(arr))
        specs[name] = dict(shape=list(arr.shape), dtype=str(arr.dtype))
    return specs, meta, round(time.perf_counter() - start, 3)


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
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _failed_marker(root: Path, entry: str) -> Path:
    return root / f".{entry}.failed"


def build(root: Path, entry: str, key: dict, builder: str, args: tuple, in_child: bool, error: type) -> None:
    """Build the entry into a temporary folder and rename it into place."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CacheError(f"data.cache {root}: cannot create it ({err.strerror}).\nHINT: data.cache=DIR on a "
                         f"writable disk, or data.cache=off (every launch parses again)") from None
    _failed_marker(root, entry).unlink(missing_ok=True)
    tmp = root / f".{entry}.{socket.gethostname()}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if in_child:
            proc = multiprocessing.get_context("spawn").Process(target=_child, args=(tmp, builder, args, key))
            proc.start()
            proc.join()
            failure = tmp.with_suffix(".error")
            if failure.exists():
                info = json.loads(failure.read_text())
                failure.unlink()
                raise (error if info["type"] != "CacheError" else CacheError)(info["message"])
            if proc.exitcode != 0:
                raise CacheError(f"data.cache: the process building {entry} exited {proc.exitcode}")
        else:
            specs, meta, seconds = _build_into(tmp, builder, args)
            _write_manifest(tmp, key, specs, meta, seconds)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _failed_marker(root, entry).write_text(f"{type(err).__name__}: {err}")
        except OSError:
            pass
        raise
    target = root / entry
    stale = load(target, key) is None and target.exists()
    if stale:                                    # damaged or of another key under this name: never trusted
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:                              # another node's build won the race: keep the winner's
        shutil.rmtree(tmp, ignore_errors=True)


def prune(root: Path, name: str, entry: str, source: str) -> None:
    """Remove the older entries of the same source (the data or its settings changed since)."""
    for other in root.glob(f"{name}-*"):
        if other.name == entry:
            continue
        try:
            if json.loads((other / "manifest.json").read_text())["key"].get("source") == source:
                shutil.rmtree(other, ignore_errors=True)
                log.info("data cache: removed %s (built from an older version of %s or other settings)", other,
                         source)
        except (OSError, ValueError, KeyError, AttributeError):
            continue


def wait(root: Path, entry: str, key: dict, timeout_s: float, error: type) -> tuple[dict, dict]:
    """The entry another rank of this node builds, once it is in place (a line every REPORT_S seconds)."""
    start = last = time.monotonic()
    while (got := load(root / entry, key)) is None:
        failed = _failed_marker(root, entry)
        if failed.exists():
            raise error(f"the data cache's build failed on local rank 0: {failed.read_text()}")
        now = time.monotonic()
        if now - start > timeout_s:
            raise CacheError(f"data.cache: {root / entry} not built within {timeout_s:.0f} s by local rank 0")
        if now - last >= REPORT_S:
            log.info("waiting for local rank 0 to parse the data into %s (%.0f s)", root / entry, now - start)
            last = now
        time.sleep(POLL_S)
    return got


def load_or_build(root: Path, name: str, key: dict[str, Any], builder: str, args: tuple, local_rank: int = 0,
                  timeout_s: float = 1800.0, in_child: bool = False, error: type = CacheError):
    """(arrays, meta) of the entry for `key` under root: loaded, or built once on this node by local rank 0
    (the other ranks wait). `key["source"]` names the data (older entries of it are pruned); `error` is the
    exception type a failed build is raised as (the recipe's DataError)."""
    entry = entry_name(name, key)
    start = time.perf_counter()
    got = load(root / entry, key)
    if got is not None:
        log.info("data cache: %s memory-mapped in %.2f s", root / entry, time.perf_counter() - start)
        for message in got[1].get("warnings", []):
            log.warning("%s (said when the data was parsed into the cache)", message)
        return got
    if local_rank != 0:
        return wait(root, entry, key, timeout_s, error)
    log.info("parsing the data into the cache %s (once: later launches map it)", root / entry)
    build(root, entry, key, builder, args, in_child, error)
    got = load(root / entry, key)
    if got is None:
        raise CacheError(f"data.cache: {root / entry} was built but cannot be read back")
    prune(root, name, entry, str(key.get("source", "")))
    log.info("data cache: %s built in %.1f s", root / entry, time.perf_counter() - start)
    return got


def load_or_build_files(root: Path, name: str, source: Path, files: list[Path], settings: dict[str, Any],
                        builder: str, args: tuple, local_rank: int = 0, error: type = CacheError):
    """load_or_build for data read from files: the key is the files' fingerprint (remembered under
    ROOT/fingerprints) and the parse's settings; files of CHILD_FROM bytes or more together are parsed in a child
    process where this process's malloc keeps freed memory."""
    key = dict(source=str(source), sha256=fingerprints(files, root / "fingerprints"), **settings)
    return load_or_build(root, name, key, builder, args, local_rank, error=error,
                         in_child=sum(f.stat().st_size for f in files) >= CHILD_FROM and memory.keeps_freed_memory())

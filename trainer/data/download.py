"""Resumable, checksum-verified downloads of public datasets.

    python -m trainer data download ml-100k --out data/
    python -m trainer data download ml-1m --out data/ --url http://mirror.local/ml-1m.zip   # a mirror

The datasets are the recipes' own (RecipeSpec.tools.datasets: sasrec's MovieLens, kgat's, har's UCI HAR); this module
is the machinery they share. A partial transfer is kept as NAME.part and continued with an HTTP Range request;
the archive is only renamed into place (and extracted) once its sha256 matches.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import stat
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
CHUNK = 1 << 16


@dataclass(frozen=True)
class Remote:
    """A downloadable archive: canonical URL, sha256 and size in bytes."""

    url: str
    sha256: str
    size: int
    extract: bool = True



class DownloadError(RuntimeError):
    """The transfer failed or the file does not match its checksum."""


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _progress(total: int | None, initial: int, name: str):
    try:
        from trainer.native.console import progress_bar
        return progress_bar(total=total, initial=initial, unit="B", unit_scale=True, desc=name, leave=False)
    except ImportError:  # tqdm is a dependency; degrade to no bar
        return None


def download_failure(url: str, part: Path, dest: Path, err: BaseException) -> str:
    """Why a download stopped and what to do: a name that does not resolve or a refused connection is no network
    (nothing to resume: fetch it where there is one and copy it here); a transfer cut short resumes from `part`."""
    import socket
    size = part.stat().st_size if part.exists() else 0
    reason = getattr(err, "reason", err)
    host = urllib.parse.urlsplit(url).hostname
    if isinstance(reason, socket.gaierror) or isinstance(reason, ConnectionRefusedError) and not size:
        what = f"cannot resolve {host}" if isinstance(reason, socket.gaierror) else f"{host} refused the connection"
        return (f"download of {url} failed: {what} ({reason}): no network here? Fetch it on a machine that has one "
                f"and copy it to {dest} (its checksum is checked here), or set data.path to where the data is")
    if size:
        return f"download of {url} failed after {size} bytes ({err}); run the same command again to resume from {part}"
    return f"download of {url} failed before any byte arrived ({err}); run the same command again to retry"


def fetch(url: str, dest: Path, sha256: str | None, timeout: float = 60.0) -> Path:
    """Download url to dest (resuming dest.part), verify sha256 (None: the caller checks), rename atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and sha256 is not None and sha256_of(dest) == sha256:
        log.info("%s already present and verified", dest)
        return dest
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if have and resp.status != 206:  # server ignored the Range: start over
                log.warning("server does not resume (HTTP %d): downloading %s from the start", resp.status, url)
                have = 0
            length = resp.headers.get("Content-Length")
            bar = _progress(int(length) + have if length else None, have, dest.name)
            got = 0
            with open(part, "ab" if have else "wb") as fh:
                for block in iter(lambda: resp.read(CHUNK), b""):
                    fh.write(block)
                    got += len(block)
                    if bar is not None:
                        bar.update(len(block))
            if bar is not None:
                bar.close()
            if length is not None and got < int(length):   # the server closed the connection early
                raise OSError(f"connection closed after {got} of {length} bytes")
    except (urllib.error.URLError, OSError) as err:
        raise DownloadError(download_failure(url, part, dest, err)) from None
    got = sha256_of(part)
    if sha256 is not None and got != sha256:
        bad = part.with_name(part.name + ".bad")
        os.replace(part, bad)
        raise DownloadError(f"{url}: sha256 mismatch (expected {sha256}, got {got}); the file was kept as "
                            f"{bad} and will not be used")
    os.replace(part, dest)
    return dest


def fetch_remote(remote: Remote, out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    """One archive (from `url`, a mirror, else its canonical URL) into out/, verified, then extracted; returns the
    extracted folder (or the archive where it is not extracted)."""
    archive = fetch(url or remote.url, Path(out) / Path(remote.url).name, sha256 or remote.sha256)
    if not remote.extract:
        return archive
    with zipfile.ZipFile(archive) as zf:
        safe_extract(zf, Path(out), archive)
        top = zf.namelist()[0].split("/")[0]
    return Path(out) / top


def registered() -> dict[str, Any]:
    """Every downloadable dataset: name -> the spec's Dataset (each recipe declares its own)."""
    from trainer.config.registry import specs
    return {name: ds for spec in specs() for name, ds in spec.tools.datasets.items()}


def download(name: str, out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    """Fetch a registered dataset into out/ (and extract it); returns the extracted folder or file."""
    known = registered()
    if name not in known:
        raise DownloadError(f"unknown dataset {name!r}; known: {', '.join(sorted(known))}")
    return known[name].download(out, url=url, sha256=sha256)


def safe_extract(zf: zipfile.ZipFile, out: Path, archive: Path) -> None:
    """Extract every member, refusing any whose resolved path leaves the output folder (`../`, absolute
    names, or a path through a symlink already in out/) and members stored as symlinks."""
    root = out.resolve()
    for info in zf.infolist():
        target = (out / info.filename).resolve()
        if not target.is_relative_to(root) or target == root and not info.is_dir():
            raise DownloadError(f"{archive}: unsafe member path {info.filename!r} (outside {out})")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise DownloadError(f"{archive}: member {info.filename!r} is a symbolic link (refused)")
    zf.extractall(out)


# ------------------------------------------------------------------------------ files pinned one by one

@dataclass(frozen=True)
class Pin:
    """How a downloaded file is verified: kind 'sha256' or 'git-blob-sha1', the hex digest, the size if known."""

    kind: str
    digest: str
    size: int | None = None


def parse_pins(text: str) -> dict[str, dict[str, Pin]]:
    """`DATASET FILE sha256=HEX size=N` or `DATASET FILE git-blob-sha1=HEX` lines -> {dataset: {file: Pin}}."""
    out: dict[str, dict[str, Pin]] = {}
    for line in text.strip().splitlines():
        name, fname, *fields = line.split()
        kv = dict(f.split("=", 1) for f in fields)
        kind = "sha256" if "sha256" in kv else "git-blob-sha1"
        out.setdefault(name, {})[fname] = Pin(kind, kv[kind], int(kv["size"]) if "size" in kv else None)
    return out


SUMS = "SHA256SUMS"


def git_blob_sha1(path: Path) -> str:
    """git's blob id of a file: sha1 of b"blob <size>\0" and its bytes."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sums(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    out = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise DownloadError(f"{path}:{lineno}: expected 'SHA256  FILE', got {line!r}")
        out[parts[1]] = parts[0]
    return out


def fetch_pinned(url: str, path: Path, pin: Pin | None, recorded: dict[str, str]) -> None:
    """One file, verified by its pin (None: by the sha256 an earlier download recorded, else recorded now)."""
    if pin is not None and pin.kind == "sha256":
        fetch(url, path, pin.digest)
        recorded[path.name] = pin.digest
        return
    fetch(url, path, recorded.get(path.name))
    if pin is not None and path.name not in recorded and git_blob_sha1(path) != pin.digest:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        raise DownloadError(f"{url}: git blob sha1 mismatch (expected {pin.digest}, got {git_blob_sha1(bad)}); the "
                            f"file was kept as {bad} and will not be used")
    if pin is None and path.name not in recorded:
        log.warning("no pinned hash for %s; recorded its sha256 in %s (later downloads must match it)", path,
                    path.parent / SUMS)
    recorded[path.name] = sha256_of(path)


# ------------------------------------------------------------------------------ where a missing dataset comes from

def download_hint(path: str | Path) -> str:
    """How to get the dataset a missing data.path names (the folders the `data download` commands write)."""
    from trainer.config.registry import specs
    path = Path(path)
    parent = shlex.quote(str(path.parent) + "/")
    for name, ds in registered().items():
        if path.name in (name, ds.folder):
            return f"python -m trainer data download {name} --out {parent}"
    for spec in specs():
        if path.name in spec.tools.data_hints:
            return spec.tools.data_hints[path.name].format(parent=parent, path=shlex.quote(str(path)))
    return "copy the dataset there"


def check_data_path(path: str) -> None:
    """A data.path that names nothing stops the run before any process group forms, saying where the data
    comes from (generated data is used only when data.path is empty, as in the recipes' defaults)."""
    if path and not Path(path).exists():
        raise DownloadError(f"data.path {path} does not exist.\nHINT: {download_hint(path)}, or set "
                            f"data.path=DIR where it is (data.path= with no value trains on generated data; under "
                            f"Slurm or submitit with data.synthetic=true as well)")

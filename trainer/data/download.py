"""Resumable, checksum-verified downloads of public datasets.

    python -m trainer data download ml-100k --out data/
    python -m trainer data download ml-1m --out data/ --url http://mirror.local/ml-1m.zip   # a mirror
    python -m trainer data download amazon-book --out data/     # KGAT authors' files -> data/amazon-book/
    python -m trainer data download uci-har --out data/         # -> data/UCI HAR Dataset/

A partial transfer is kept as NAME.part and continued with an HTTP Range request; the archive is only
renamed into place (and extracted) once its sha256 matches.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import stat
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
CHUNK = 1 << 16


@dataclass(frozen=True)
class Remote:
    """A downloadable archive: canonical URL, sha256 and size in bytes."""

    url: str
    sha256: str
    size: int
    extract: bool = True


# sha256 and sizes as published in tensorflow/datasets' url_checksums/movielens.txt
REMOTES: dict[str, Remote] = {
    "ml-100k": Remote("https://files.grouplens.org/datasets/movielens/ml-100k.zip",
                      "50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229", 4924029),
    "ml-1m": Remote("https://files.grouplens.org/datasets/movielens/ml-1m.zip",
                    "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20", 5917549),
}


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
        from trainer.engine.logging import progress_bar
        return progress_bar(total=total, initial=initial, unit="B", unit_scale=True, desc=name, leave=False)
    except ImportError:  # tqdm is a dependency; degrade to no bar
        return None


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
        size = part.stat().st_size if part.exists() else 0
        raise DownloadError(f"download of {url} failed after {size} bytes ({err}); run the same command "
                            f"again to resume from {part}") from None
    got = sha256_of(part)
    if sha256 is not None and got != sha256:
        bad = part.with_name(part.name + ".bad")
        os.replace(part, bad)
        raise DownloadError(f"{url}: sha256 mismatch (expected {sha256}, got {got}); the file was kept as "
                            f"{bad} and will not be used")
    os.replace(part, dest)
    return dest


def download(name: str, out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    """Fetch a registered dataset into out/ (and extract it); returns the extracted folder or file."""
    if name in KGAT_DATASETS:
        return download_kgat(name, out, base_url=url)
    if name == "uci-har":
        return download_uci_har(out, url=url, sha256=sha256)
    if name not in REMOTES:
        known = sorted([*REMOTES, *KGAT_DATASETS, "uci-har"])
        raise DownloadError(f"unknown dataset {name!r}; known: {', '.join(known)}")
    remote = REMOTES[name]
    src = url or remote.url
    archive = fetch(src, Path(out) / Path(remote.url).name, sha256 or remote.sha256)
    if not remote.extract:
        return archive
    with zipfile.ZipFile(archive) as zf:
        safe_extract(zf, Path(out), archive)
        top = zf.namelist()[0].split("/")[0]
    return Path(out) / top


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


# ------------------------------------------------------------------------------ KGAT datasets (file by file)

KGAT_REPO = "https://raw.githubusercontent.com/xiangwang1223/knowledge_graph_attention_network"
# a commit, never a branch. amazon-book: the commit other importers of this release pin (their audit reads
# kg_final.txt.zip from it); last-fm, yelp2018: the commits that added those datasets' files (a public code
# index). No machine of this project reaches GitHub, so the files' sha256 are recorded at the first download.
KGAT_COMMITS = {"amazon-book": "c03737be46ac26a0b5431efe149828e982ffbbfb",
                "last-fm": "a018ee4b71ed9ff4af0167474121eaed1bd8f57d",
                "yelp2018": "0fc6fb2107aed63e48a750ff78f1d4cd8ba9aff2"}
KGAT_FILES = ("train.txt", "test.txt", "kg_final.txt.zip", "item_list.txt", "entity_list.txt",
              "relation_list.txt", "user_list.txt")
# Pinned sha256 per file. None: not pinned yet (no machine of this project can reach GitHub); the first
# download records the hashes in DIR/SHA256SUMS and every later run is verified against them.
KGAT_DATASETS: dict[str, dict[str, str | None]] = {
    name: {f: None for f in KGAT_FILES} for name in ("amazon-book", "last-fm", "yelp2018")
}
SUMS = "SHA256SUMS"


def _read_sums(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    out = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise DownloadError(f"{path}:{lineno}: expected 'SHA256  FILE', got {line!r}")
        out[parts[1]] = parts[0]
    return out


def download_kgat(name: str, out: str | Path, base_url: str | None = None,
                  pinned: dict[str, str | None] | None = None) -> Path:
    """The KGAT authors' files of one dataset into out/name/, each sha256-verified, the KG unzipped."""
    folder = Path(out) / name
    pinned = dict(KGAT_DATASETS[name] if pinned is None else pinned)
    sums_path = folder / SUMS
    recorded = _read_sums(sums_path)
    base = (base_url or f"{KGAT_REPO}/{KGAT_COMMITS[name]}/Data/{name}").rstrip("/") + "/"
    for fname, digest in pinned.items():
        expected = digest or recorded.get(fname)
        path = fetch(base + fname, folder / fname, expected)
        if expected is None:
            recorded[fname] = sha256_of(path)
            log.warning("%s: no pinned sha256 for %s; recorded %s in %s (later downloads must match it)",
                        name, fname, recorded[fname], sums_path)
        else:
            recorded[fname] = expected
    sums_path.write_text("".join(f"{h}  {f}\n" for f, h in sorted(recorded.items())))
    for fname in pinned:
        if fname.endswith(".zip"):
            with zipfile.ZipFile(folder / fname) as zf:
                safe_extract(zf, folder, folder / fname)
    return folder


# ------------------------------------------------------------------------------ UCI HAR (an archive in an archive)

UCI_HAR_URL = "https://archive.ics.uci.edu/static/public/240/human+activity+recognition+using+smartphones.zip"
UCI_HAR_SHA256 = "c00b803081a5c797cd5e4b83700a9810b38d53d9d84e01917e090e1fdbc81031"   # UCI's wrapper archive
UCI_HAR_ROOT = "UCI HAR Dataset"             # the folder the archive unpacks to
UCI_HAR_INNER = "UCI HAR Dataset.zip"       # the original 2012 archive inside it (also what mirrors serve)
UCI_HAR_INNER_SHA256 = "2045e435c955214b38145fb5fa00776c72814f01b203fec405152dac7d5bfeb0"


def download_uci_har(out: str | Path, url: str | None = None, sha256: str | None = None,
                     inner_sha256: str | None = None) -> Path:
    """UCI HAR into out/'UCI HAR Dataset'. The download must be UCI's archive (its inner zip is verified too)
    or, from a mirror (--url), the original inner zip itself; anything else is refused and kept aside."""
    out = Path(out)
    outer_sha, inner_sha = sha256 or UCI_HAR_SHA256, inner_sha256 or UCI_HAR_INNER_SHA256
    archive = out / "uci-har.zip"
    digest = sha256_of(archive) if archive.exists() else None
    if digest not in (outer_sha, inner_sha):
        fetch(url or UCI_HAR_URL, archive, None)
        digest = sha256_of(archive)
        if digest not in (outer_sha, inner_sha):
            bad = archive.with_name(archive.name + ".bad")
            os.replace(archive, bad)
            raise DownloadError(f"{url or UCI_HAR_URL}: sha256 {digest} is neither UCI's archive ({outer_sha}) nor "
                                f"the original '{UCI_HAR_INNER}' ({inner_sha}); kept as {bad}, not used")
    inner = archive
    if digest == outer_sha:
        inner = out / UCI_HAR_INNER
        with zipfile.ZipFile(archive) as zf:
            if UCI_HAR_INNER not in zf.namelist():
                raise DownloadError(f"{archive}: no '{UCI_HAR_INNER}' inside (members: {zf.namelist()[:5]})")
            tmp = inner.with_name(inner.name + ".part")
            with zf.open(UCI_HAR_INNER) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        if sha256_of(tmp) != inner_sha:
            raise DownloadError(f"{archive}: '{UCI_HAR_INNER}' inside has sha256 {sha256_of(tmp)}, expected {inner_sha}")
        os.replace(tmp, inner)
    with zipfile.ZipFile(inner) as zf:
        safe_extract(zf, out, inner)
    root = out / UCI_HAR_ROOT
    if not (root / "train" / "y_train.txt").exists():
        raise DownloadError(f"{inner}: extracted, but {root}/train/y_train.txt is missing")
    return root


# ------------------------------------------------------------------------------ where a missing dataset comes from

def download_hint(path: str | Path) -> str:
    """How to get the dataset a missing data.path names (the folders the `data download` commands write)."""
    path = Path(path)
    parent = shlex.quote(str(path.parent) + "/")
    if path.name in REMOTES or path.name in KGAT_DATASETS:
        return f"python -m trainer data download {path.name} --out {parent}"
    if path.name == UCI_HAR_ROOT:
        return f"python -m trainer data download uci-har --out {parent}"
    if path.name == "ml-100k-kg":
        src = shlex.quote(str(path.parent / "ml-100k"))
        return (f"python -m trainer data download ml-100k --out {parent} && python -m trainer data convert "
                f"movielens-kg --src {src} --out {shlex.quote(str(path))}")
    return "copy the dataset there"


def check_data_path(path: str) -> None:
    """A data.path that names nothing stops the run before any process group forms, saying where the data
    comes from (generated data is used only when data.path is empty, as in the recipes' defaults)."""
    if path and not Path(path).exists():
        raise DownloadError(f"data.path {path} does not exist.\nHINT: {download_hint(path)}, or set "
                            f"data.path=DIR where it is (data.path= with no value trains on generated data)")

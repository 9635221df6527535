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
# a commit, never a branch: the repository's head, which holds all three datasets (the commits pinned before,
# a018ee4b for last-fm and 0fc6fb21 for yelp2018, hold no kg_final file). Each file is pinned by its sha256,
# or where only git's blob id of the five largest could be read, by that (sha1 of "blob <size>\0" + bytes:
# what the commit serves); a file pinned so is recorded by its sha256 in DIR/SHA256SUMS once verified.
KGAT_COMMIT = "c03737be46ac26a0b5431efe149828e982ffbbfb"
_KGAT_PINS = """
amazon-book entity_list.txt sha256=b03e9cb7eeab38756f0b10c06478a611201a7d42cb16acb8513624dda05270ca size=1810815
amazon-book item_list.txt sha256=efea8518cd68e515584fdfbfca95f318b25ef551c64498c5935897c2b02e436f size=658401
amazon-book kg_final.txt.zip git-blob-sha1=7eedb0ed50a9bae8a89ef2193b3a9fb1bf9ed03e
amazon-book relation_list.txt sha256=50fe9c6560224b20d8ace78ae8ca0b8dad39248f6dc900f6744b633ba8c33f4b size=2424
amazon-book test.txt sha256=f47eff9d35fb95c07d74251a991478a84095ce6c5969b0dafcb4afe99fc716ec size=1478039
amazon-book train.txt sha256=4d10106bb06a77e11df660429903c0067aeb85b86431807836b0d8b7edc30c38 size=3897477
amazon-book user_list.txt sha256=ae2e001d4e49fd82d4c7e25f950827a8be2fbd5c6f3a16dacb2d104edb32310e size=1454742
last-fm entity_list.txt sha256=56741c54984c929682ffb89f5e255ebdbf862fa031157220474139824d4f9ba7 size=1656602
last-fm item_list.txt sha256=0e4991b5b8a292e82dc5fe3ca34bd04dc90bdeee63e0b99d71b4b8d93c129e80 size=1065416
last-fm kg_final.txt git-blob-sha1=42d2726e067d743bf73891a7ff8caddb5c1adf84
last-fm relation_list.txt sha256=069643eab7dea9e21b02e8c7b8df4af91fb70f0628a5a36cb3091cfcb87d8e7d size=512
last-fm test.txt sha256=bb79750f3a034e5ce5bc4aa8541cdc9d456ea51158f0059f84167942bd9837b2 size=3522888
last-fm train.txt git-blob-sha1=905779bf273225caa33049cef2b6cf9b923bd139
last-fm user_list.txt sha256=3ccf277897bbc1cdc7ca6689f76045397462a8dc69615a7e47ed10f88e180f0d size=335974
yelp2018 entity_list.txt sha256=bb6390ee1568eed802d5113a6b4b38e76402bce88519186d2a99402955571801 size=4025349
yelp2018 item_list.txt sha256=1ba988c00ea8d97945a5fb0f6cbb3867e55f327e2c341bcfe55c5a5584b06a9d size=2311356
yelp2018 kg_final.txt.zip git-blob-sha1=9a11bad2806d43f613787f000d8d826f3bc91767
yelp2018 relation_list.txt sha256=f5b19de6fc169ec6f4ac9943cce7614d1427b32130a6063f990721b45e636abc size=1167
yelp2018 test.txt sha256=ad1034bf609176893abcce4b7b9266d9f02fcc05e13966aa078b432df02a78f0 size=1676196
yelp2018 train.txt git-blob-sha1=c834b6e61cbb6a716b039367f3ddd711ca3a2483
yelp2018 user_list.txt sha256=49b8f178a6a6ee71d0d0b06242628afe9289d27734d44fa31f6d07aa4611b7be size=1320557
"""


@dataclass(frozen=True)
class Pin:
    """How a downloaded file is verified: kind 'sha256' or 'git-blob-sha1', the hex digest, the size if known."""

    kind: str
    digest: str
    size: int | None = None


def _parse_pins(text: str) -> dict[str, dict[str, Pin]]:
    out: dict[str, dict[str, Pin]] = {}
    for line in text.strip().splitlines():
        name, fname, *fields = line.split()
        kv = dict(f.split("=", 1) for f in fields)
        kind = "sha256" if "sha256" in kv else "git-blob-sha1"
        out.setdefault(name, {})[fname] = Pin(kind, kv[kind], int(kv["size"]) if "size" in kv else None)
    return out


# per dataset, its own file names (last-fm's knowledge graph is kg_final.txt, the others' kg_final.txt.zip)
KGAT_DATASETS: dict[str, dict[str, Pin]] = _parse_pins(_KGAT_PINS)
KGAT_COMMITS = {name: KGAT_COMMIT for name in KGAT_DATASETS}
SUMS = "SHA256SUMS"


def git_blob_sha1(path: Path) -> str:
    """git's blob id of a file: sha1 of b"blob <size>\0" and its bytes."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def _fetch_pinned(url: str, path: Path, pin: Pin | None, recorded: dict[str, str]) -> None:
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


def download_kgat(name: str, out: str | Path, base_url: str | None = None,
                  pinned: dict[str, Pin | str | None] | None = None) -> Path:
    """The KGAT authors' files of one dataset into out/name/, each verified (sha256, or git's blob id), the KG
    unzipped where it is zipped. pinned (tests, mirrors): file -> Pin, a sha256 string, or None (record)."""
    folder = Path(out) / name
    pins = {f: Pin("sha256", p) if isinstance(p, str) else p
            for f, p in (KGAT_DATASETS[name] if pinned is None else pinned).items()}
    sums_path = folder / SUMS
    recorded = _read_sums(sums_path)
    base = (base_url or f"{KGAT_REPO}/{KGAT_COMMITS[name]}/Data/{name}").rstrip("/") + "/"
    for fname, pin in pins.items():
        _fetch_pinned(base + fname, folder / fname, pin, recorded)
    sums_path.write_text("".join(f"{h}  {f}\n" for f, h in sorted(recorded.items())))
    for fname in pins:
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

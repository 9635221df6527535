"""UCI HAR for `data download uci-har` (declared in this recipe's spec): an archive inside UCI's archive."""
from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from trainer.data.download import DownloadError, fetch, safe_extract, sha256_of

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
            raise DownloadError(f"{archive}: '{UCI_HAR_INNER}' inside has sha256 {sha256_of(tmp)}, expected "
                                f"{inner_sha}")
        os.replace(tmp, inner)
    with zipfile.ZipFile(inner) as zf:
        safe_extract(zf, out, inner)
    root = out / UCI_HAR_ROOT
    if not (root / "train" / "y_train.txt").exists():
        raise DownloadError(f"{inner}: extracted, but {root}/train/y_train.txt is missing")
    return root


def uci_har(out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    return download_uci_har(out, url=url, sha256=sha256)

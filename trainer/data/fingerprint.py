"""What a data file is: the sha256 of its content, remembered under (path, size, mtime, inode) so that a warm start
does not read the file again. The one fingerprint of the project's caches (the parsed-data cache, trainer/data/
cache.py, and the video frame cache's manifest).

    fingerprint(Path("ml-20m/ratings.csv"), memo=Path("~/.cache/hpc-trainer/data/fingerprints"))
    fingerprints([path_a, path_b], memo)        # several files (KGAT's), in the order given

A file that changes keeps its path but not its size or mtime (or, replaced by a rename, its inode): its memo no
longer matches and its content is hashed again. A memo that cannot be written (a read-only cache) costs only that
hash at the next start.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainer.data.download import sha256_of
from trainer.data.owners import private_name


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return dict(path=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def fingerprint(path: str | Path, memo: Path | None = None) -> str:
    """The sha256 of the file's content; from `memo` (a folder) when the file's path, size, mtime and inode
    are those it was hashed at."""
    path = Path(path)
    key = _stat_key(path)
    entry = memo / (hashlib.sha256(key["path"].encode()).hexdigest()[:24] + ".json") if memo else None
    if entry is not None:
        try:
            known = json.loads(entry.read_text())
            if {k: known.get(k) for k in key} == key and isinstance(known.get("sha256"), str):
                return known["sha256"]
        except (OSError, ValueError):
            pass
    digest = sha256_of(path)
    if entry is not None and _stat_key(path) == key:      # not changed while it was read
        tmp = private_name(entry)
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(dict(key, sha256=digest)))
            os.replace(tmp, entry)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return digest


def fingerprints(paths: list[Path], memo: Path | None = None) -> str:
    """One fingerprint of several files: the sha256 of their names and fingerprints, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{Path(path).name}\0{fingerprint(path, memo)}\n".encode())
    return digest.hexdigest()


def files_under(path: str | Path) -> list[Path]:
    """The data files of data.path: the file itself, or every file below the folder but hidden ones and those in
    hidden folders (a recipe's caches: video's .frame-cache), in a stable order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def data_fingerprint(files: list[Path], counts: dict, base: str | Path | None, memo: Path | None) -> dict:
    """What a run trains on: per file (named relative to `base`, data.path, so a moved copy is the same data)
    its size and content hash, and the recipe's counts (users, items, interactions, classes...)."""
    base = Path(base) if base else None

    def name(p: Path) -> str:
        if base is not None and base.is_dir():
            try:
                return str(p.relative_to(base))
            except ValueError:
                pass
        return p.name
    return dict(files={name(Path(p)): dict(size=Path(p).stat().st_size, sha256=fingerprint(p, memo))
                       for p in files},
                counts={k: int(v) for k, v in counts.items()})


def data_changes(saved: dict | None, now: dict) -> list[str]:
    """What differs between two data_fingerprint()s, one phrase per file or count; [] when they agree (or the
    checkpoint predates fingerprints: saved None)."""
    if not saved:
        return []
    out = []
    old, new = saved.get("files", {}), now.get("files", {})
    for f in sorted(set(old) | set(new)):
        if f not in new:
            out.append(f"{f}: gone")
        elif f not in old:
            out.append(f"{f}: new")
        elif old[f]["size"] != new[f]["size"]:
            out.append(f"{f}: {old[f]['size']:,} -> {new[f]['size']:,} bytes")
        elif old[f]["sha256"] != new[f]["sha256"]:
            out.append(f"{f}: same size, other content (sha256 {old[f]['sha256'][:12]} -> {new[f]['sha256'][:12]})")
    old, new = saved.get("counts", {}), now.get("counts", {})
    out += [f"{k} {_count(old.get(k))} -> {_count(new.get(k))}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]
    return out


def _count(value) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)

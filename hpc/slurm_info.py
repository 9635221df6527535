"""Small, pure helpers about Slurm values (time limits, GRES strings) and one `sinfo` query."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path


class SubmitError(ValueError):
    """A problem found before anything was submitted."""


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_min(text: str) -> int:
    """Slurm time formats -> whole minutes (rounded up): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.match(text.strip())
    if not m:
        raise SubmitError(f"--time {text!r}: expected MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:   # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:   # M:S
        seconds = int(a) * 60 + int(b)
    else:                 # M
        seconds = int(a) * 60
    if seconds <= 0:
        raise SubmitError(f"--time {text!r} must be positive")
    return math.ceil(seconds / 60)


def gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES string: 'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:8', '(null)'."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_gpus(partition: str | None) -> tuple[str, int] | None:
    """(partition, most GPUs on any of its nodes) from `sinfo`; None when sinfo is unavailable.

    Without a partition the cluster's default one (marked '*' by sinfo) is used.
    """
    exe = shutil.which("sinfo")
    if exe is None:
        return None
    proc = subprocess.run([exe, "-h", "-N", "-o", "%P|%G"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return None
    best: dict[str, int] = {}
    default = None
    for line in proc.stdout.splitlines():
        name, _, gres = line.partition("|")
        if name.endswith("*"):
            name = default = name[:-1]
        best[name] = max(best.get(name, 0), gres_gpus(gres))
    name = partition or default
    if name is None:
        return None
    if name not in best:
        known = ", ".join(sorted(best)) or "none"
        raise SubmitError(f"--partition {name!r} does not exist (sinfo lists: {known})")
    return name, best[name]


def srun_supports(flag: str) -> bool:
    """Whether this cluster's srun knows a flag (pyxis adds --container-image)."""
    exe = shutil.which("srun")
    if exe is None:
        return False
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
    return flag in proc.stdout + proc.stderr


def local_cluster_dir() -> Path | None:
    """The directory of the local test cluster (hpc/cluster/where.sh): HPC_CLUSTER_DIR, else the path that
    start.sh recorded in the user's state directory; None when there is none."""
    if os.environ.get("HPC_CLUSTER_DIR"):
        return Path(os.environ["HPC_CLUSTER_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    pointer = Path(os.environ.get("HPC_CLUSTER_POINTER") or Path(state) / "hpc-trainer" / "cluster-dir")
    text = pointer.read_text().strip() if pointer.is_file() else ""
    return Path(text) if text else None

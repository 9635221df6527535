"""Every timeout the tests wait with, from one table scaled by one factor: TEST_TIMEOUT_SCALE (default 1; 2 on a
machine half as fast, or beside a heavy load). A timeout only ends a wait that has already failed: scaled up it
makes a slow machine's failing test fail later, never a passing one fail. The verdicts themselves (a rank named
within faults.hang_timeout_s + 30 s, a take-over within 10 s) are the product's bounds and are not scaled.

    limit("run")    # 120 s x TEST_TIMEOUT_SCALE
"""
from __future__ import annotations

import os

TABLE = {
    "brief": 10,       # a thread or a process that should already be done
    "short": 30,       # a process that refuses or answers at once (--help, a bad flag, doctor)
    "minute": 60,      # a small training in one process, a dry run
    "run": 120,        # a small training of a few ranks
    "runs": 180,       # a training with its resume, the default of tests/procs.py's helpers
    "start": 240,      # a recipe at its shipped defaults (video: its clips made and decoded first)
    "long": 300,       # a launcher's group (torchrun, srun), a benchmark's smoke run, a podman run
    "job": 400,        # a job on the local Slurm cluster, queued behind others
    "jobs": 600,       # several jobs, a requeue after a time limit, an image build
}


def scale() -> float:
    raw = os.environ.get("TEST_TIMEOUT_SCALE") or "1"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TEST_TIMEOUT_SCALE={raw!r}: not a number (a factor, e.g. 2)") from None
    if value <= 0:
        raise ValueError(f"TEST_TIMEOUT_SCALE={raw!r}: must be above 0")
    return value


def limit(name: str) -> float:
    """The named timeout in seconds, scaled."""
    if name not in TABLE:
        raise KeyError(f"no timeout named {name!r} in tests/timeouts.py (there: {', '.join(TABLE)})")
    return TABLE[name] * scale()

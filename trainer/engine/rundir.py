"""The run directory before training: claimed (no fresh run over old checkpoints, no stale temporaries) and,
with --private, readable by its owner only.

    claim_run_dir("runs/x", resume="auto", info=info)
"""
from __future__ import annotations

import os
from pathlib import Path

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine import checkpoint as ckpt_io


def claim_run_dir(run_dir: str | Path, resume: str, info: DistInfo) -> None:
    """Before anything is written: remove temporaries of interrupted saves and refuse a fresh run into a
    run directory with checkpoints. Rank 0 looks (run directories need not be shared); all ranks raise."""
    problem = None
    if info.is_main:
        manager = ckpt_io.CheckpointManager(run_dir)
        manager.remove_temporaries()
        try:
            if not resume:
                ckpt_io.refuse_fresh_run(run_dir)
        except ckpt_io.CheckpointError as err:
            problem = str(err)
    problem = runtime.broadcast_object(problem, info)
    if problem:
        raise ckpt_io.CheckpointError(problem)


def make_private(run_dir: str | Path | None = None) -> None:
    """From now on this process creates files and folders for its owner only (umask 077); an existing run
    directory (a resumed run that was not private) is tightened to owner-only as well."""
    os.umask(0o077)
    if run_dir is None or not Path(run_dir).exists():
        return
    root = Path(run_dir)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode & 0o700)

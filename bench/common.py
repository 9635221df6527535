"""What every benchmark script does: run the trainer in a fresh run directory as a subprocess of this
Python, from the repository root, and read its metrics.jsonl with the trainer's own reader.

    rows, wall = run_trainer(["--recipe", "har", "--epochs", "1"], out / "runs" / "har", threads=2)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.engine.logging import read_metrics

REPO = Path(__file__).resolve().parents[1]


def trainer_env(threads: int | str | None = None, **extra: str) -> dict[str, str]:
    """This environment with the repository importable first (plugins on PYTHONPATH stay importable) and
    OMP_NUM_THREADS set (threads, else the caller's, else 2)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    omp = str(threads) if threads is not None else os.environ.get("OMP_NUM_THREADS", "2")
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=omp, **extra)


def trainer_cmd(*args: str, ranks: int = 1) -> list[str]:
    """`python -m trainer ARGS`, under torchrun (standalone) for ranks > 1."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return [*launch, "-m", "trainer", *args]


def run_trainer(args: list[str], run_dir: Path, threads: int | str | None = None, ranks: int = 1,
                show: bool = False) -> tuple[list[dict[str, Any]], float]:
    """`trainer train ARGS --run-dir RUN_DIR` in a fresh RUN_DIR; (metrics.jsonl records, wall seconds).
    show: the trainer's output goes to this terminal instead of being kept for the error message."""
    shutil.rmtree(run_dir, ignore_errors=True)       # a fresh run, never a resume of an earlier one
    cmd = trainer_cmd("train", "--run-dir", str(run_dir), *args, ranks=ranks)
    t0 = time.time()
    proc = subprocess.run(cmd, env=trainer_env(threads), cwd=REPO, capture_output=not show, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stderr or '')[-3000:]}")
    return read_metrics(run_dir), time.time() - t0

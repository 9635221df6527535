"""What every benchmark script does: run the trainer in a fresh run directory as a subprocess of this
Python, from the repository root, and read its metrics.jsonl with the trainer's own reader.

    rows, wall = run_trainer(["--recipe", "har", "--epochs", "1"], out / "runs" / "har", threads=2)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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


def machine(**extra: Any) -> dict[str, Any]:
    """The machine a report was measured on (CPUs, Python, torch) and what else the script says of it."""
    import platform

    import torch
    return dict(cpus=os.cpu_count(), python=platform.python_version(), torch=str(torch.__version__), **extra)


def trainer_cmd(*args: str, ranks: int = 1) -> list[str]:
    """`python -m trainer ARGS`, under torchrun (standalone) for ranks > 1."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return [*launch, "-m", "trainer", *args]


def run_trainer(args: list[str], run_dir: Path, threads: int | str | None = None, ranks: int = 1,
                show: bool = False, measure: dict | None = None) -> tuple[list[dict[str, Any]], float]:
    """`trainer train ARGS --run-dir RUN_DIR` in a fresh RUN_DIR; (metrics.jsonl records, wall seconds).
    show: the trainer's output goes to this terminal instead of being kept for the error message.
    measure: a dict that gets the trainer process's peak resident memory (`peak_rss_mb`, its own rusage)."""
    shutil.rmtree(run_dir, ignore_errors=True)       # a fresh run, never a resume of an earlier one
    cmd = trainer_cmd("train", "--run-dir", str(run_dir), *args, ranks=ranks)
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=trainer_env(threads), cwd=REPO, text=True,
                                stdout=None if show else subprocess.DEVNULL, stderr=None if show else err)
        _, status, usage = os.wait4(proc.pid, 0)    # (subprocess.run reaps it without its rusage)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err.read()[-3000:]}")
    if measure is not None:
        measure["peak_rss_mb"] = round(usage.ru_maxrss / 1024, 1)        # ru_maxrss: KiB on Linux
    return read_metrics(run_dir), time.time() - t0

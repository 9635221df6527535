"""The callable that submitit pickles and runs in every task: one trainer run, requeueable.

    from hpc.task import TrainTask
    TrainTask(["--recipe", "sasrec", "--run-dir", "/abs/runs/x", "data.path=..."])()   # one process

Preemption: the engine installs flag-only handlers for USR1/USR2/TERM, ckpt.requeue_signals and submitit's
preemption signal (SUBMITIT_PREEMPT_SIGNAL, default USR2), so a signal is turned into an
agreed checkpoint on every rank. Afterwards rank 0 hands the requeue signal to submitit's own handler
(still installed underneath), which calls checkpoint() below, counts time-outs against max_num_timeout
and runs `scontrol requeue`. After SIGTERM (scancel, partition preemption) nothing is requeued here:
Slurm requeues preempted jobs itself, and a cancelled job must stay cancelled. The tasks then wait to
be killed, as submitit's own SIGTERM handler does: a job that ends by itself during the preemption
GraceTime is recorded FAILED and is not requeued (Slurm 22.05).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _bind_threads() -> None:
    """One OpenMP pool per task sized by --cpus-per-task (Slurm no longer exports OMP_NUM_THREADS)."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if cpus.isdigit() and "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(int(cpus))


class TrainTask:
    """Runs `python -m trainer train ARGV` in-process; checkpoint() resumes from the run directory."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __repr__(self) -> str:
        return f"TrainTask({self.argv!r})"

    def __call__(self) -> dict[str, Any]:
        from trainer.__main__ import run_train
        from trainer.cli import get_parser, parse_args
        from trainer.distributed.environment import select_environment
        _bind_threads()
        logging.getLogger("submitit").propagate = False   # it has its own handler: no doubled lines
        args = parse_args(get_parser(), ["train", *self.argv])
        result, cfg = run_train(args)
        where = select_environment()          # the launch facts, as the trainer read them
        summary = dict(status=result.status, global_step=result.global_step, metrics=result.metrics,
                       run_dir=os.path.abspath(cfg.run_dir), restarts=where.restart_count)
        if result.status == "preempted":
            self._after_preemption(result.signal, where.rank, signal.Signals[where.preempt_signal or "SIGUSR2"])
        return summary

    def _after_preemption(self, signum: int, rank: int, preempt: signal.Signals) -> None:
        """Every rank has saved the same checkpoint; now requeue (rank 0) or leave without a result."""
        if os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
            return  # in-process (debug): report the preempted status to the caller
        requeue = signum in (*REQUEUE_SIGNALS, preempt)
        handler = signal.getsignal(preempt)
        if requeue and rank == 0 and callable(handler):
            handler(preempt, None)  # submitit: checkpoint(), then requeue or raise
        if not requeue:
            time.sleep(float(os.environ.get("TERM_HOLD_S", 600)))
        # no result pickle for a job that goes on later (SystemExit is not caught by submitit)
        sys.exit(0 if requeue else 128 + signum)

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit on rank 0 before requeueing: the same run, resumed from its newest checkpoint."""
        import submitit
        argv = list(self.argv)
        if "--resume" in argv:
            i = argv.index("--resume")
            del argv[i:i + 2]
        return submitit.helpers.DelayedSubmission(TrainTask(argv + ["--resume", "auto"]), *args, **kwargs)

"""Preemption: signals only set a flag; ranks agree at a step boundary; rank 0 may requeue.

Slurm sends --signal=USR1/USR2 before the time limit (we requeue then), and SIGTERM on scancel,
`scontrol requeue` and partition preemption (Slurm 22.05 sends only SIGTERM there): on SIGTERM we
checkpoint and exit, and leave requeueing to Slurm, so a cancelled job stays cancelled.
"""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
from typing import Iterable

import torch

from trainer.distributed import runtime

log = logging.getLogger(__name__)
HANDLED = ("SIGUSR1", "SIGUSR2", "SIGTERM")
UNTRAPPABLE = ("SIGKILL", "SIGSTOP")


def trapped_signals(requeue_signals: Iterable[str], preempt_signal: str | None = None) -> list[str]:
    """HANDLED plus every requeue signal (ckpt.requeue_signals, the launcher's preemption signal); a name
    that is no signal, or one no process can catch, is a ValueError naming it."""
    names = list(dict.fromkeys([*HANDLED, *requeue_signals, *([preempt_signal] if preempt_signal else [])]))
    for name in names:
        if not isinstance(getattr(signal, name, None), signal.Signals) or name in UNTRAPPABLE:
            raise ValueError(f"ckpt.requeue_signals: {name!r} is not a signal this process can catch "
                             f"(e.g. SIGUSR1, SIGUSR2, SIGURG; SIGKILL and SIGSTOP cannot be caught)")
    return names


class PreemptionHandler:
    """Installs flag-only handlers for SIGUSR1/SIGUSR2/SIGTERM and restores the old ones on exit."""

    def __init__(self, signals: Iterable[str] = HANDLED):
        self.signals = [getattr(signal, name) for name in signals]
        self.received: int = 0
        self._old: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:
        self.received = signum  # no work here: the loop acts at the next step boundary

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only)."""
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def agreed_signal(self, info: runtime.DistInfo, bad_loss: bool = False) -> tuple[int, bool]:
        """(the signal any rank received, 0 if none; whether any rank saw a non-finite loss), the same on
        every rank: one max all-reduce per step carries both."""
        if not info.distributed:
            return self.received, bad_loss
        flag = torch.tensor([self.received, int(bad_loss)], dtype=torch.int64, device=runtime.comm_device(info))
        runtime.all_reduce(flag, info, op="max")
        return int(flag[0].item()), bool(flag[1].item())


def requeue_slurm_job(job_id: str) -> bool:
    """`scontrol requeue JOB_ID` (argument list, no shell); True on success."""
    exe = shutil.which("scontrol")
    if exe is None:
        log.warning("cannot requeue job %s: scontrol is not on PATH (inside a container? bind-mount it)",
                    job_id)
        return False
    proc = subprocess.run([exe, "requeue", str(job_id)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.warning("scontrol requeue %s failed: %s", job_id, proc.stderr.strip())
        return False
    log.info("requeued Slurm job %s", job_id)
    return True

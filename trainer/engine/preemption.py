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
import time
from pathlib import Path
from typing import Iterable

import torch

from trainer.distributed import runtime
from trainer.engine.callbacks import Component, RunContext, Stop
from trainer.engine.result import FitResult
from trainer.launch.exitcodes import PREEMPTED_MARKER

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


class PreemptionHandler(Component):
    """Installs flag-only handlers for SIGUSR1/SIGUSR2/SIGTERM and restores the old ones on exit."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> PreemptionHandler:
        """The signals that checkpoint and stop (ckpt.requeue_signals, the launcher's); a warning where torchrun
        would not forward one of them."""
        info = ctx.info
        trapped = trapped_signals(ctx.cfg.ckpt.requeue_signals, info.preempt_signal)
        lost = unforwarded_signals(info, trapped)
        if lost and info.is_main:
            log.warning("torchrun forwards only %s to its workers: %s (trapped here for a requeue) would end its "
                        "agent, and this job step with it, before the checkpoint.\nHINT: %s",
                        ",".join(info.agent_signals or ()), ",".join(lost), FORWARD_HINT)
        return cls(trapped)

    def __init__(self, signals: Iterable[str] = HANDLED):
        self.signals = [getattr(signal, name) for name in signals]
        self.received: int = 0
        self.received_at: float | None = None   # time.monotonic() of the first signal
        self._old: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:
        self.received = signum  # no work here: the loop acts at the next step boundary
        if self.received_at is None:
            self.received_at = time.monotonic()

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only)."""
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def fit_start(self) -> None:
        self.install()

    def fit_end(self) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def flags(self) -> torch.Tensor:
        """This rank's signal, one-hot (a sum over the ranks gives their union)."""
        flags = torch.zeros(signal.NSIG, dtype=torch.float32)
        if self.received:
            flags[self.received] = 1.0
        return flags

    @staticmethod
    def signal_of(flags) -> int:
        """The highest signal in summed flags, 0 if none."""
        got = [i for i, f in enumerate(flags) if f > 0]
        return max(got) if got else 0

    def agreed_signal(self, info: runtime.DistInfo) -> int:
        """The signal any rank received (the highest if they differ, 0 if none), the same on every rank. The
        flags are host values and travel over a host collective (gloo), so agreeing at every step never waits
        for a GPU; a step that reads its loss window sends them with it instead (LossWindow.read's extra)."""
        if not info.distributed:
            return self.received
        return self.signal_of(runtime.all_reduce_host(self.flags(), info).tolist())


class AgreementCadence:
    """Which optimizer steps agree on a signal. A logging window's read always does (it carries the flags); between
    windows, a step does once `every` steps passed since the last agreement, where `every` keeps a signal's wait under
    ckpt.signal_latency_s at the step time measured in the last window (rank 0's, agreed in that window's collective,
    so every rank counts the same steps). Until a window has measured it, and with signal_latency_s=0, every step
    agrees; a single process agrees with itself, at no cost, every step."""

    def __init__(self, info: runtime.DistInfo, latency_s: float, window: int):
        self.distributed, self.latency_s, self.window = info.distributed, latency_s, max(window, 1)
        self.every, self.last = 1, 0

    def due(self, step: int) -> bool:
        return not self.distributed or step - self.last >= self.every

    def agreed(self, step: int) -> None:
        self.last = step

    def turn(self, step: int) -> bool:
        """Whether this step agrees (then counted as the last agreement)."""
        if self.due(step):
            self.agreed(step)
            return True
        return False

    def measured(self, step_s: float) -> None:
        """The agreed wall seconds per step of the last window (0: not measured)."""
        if self.latency_s > 0 and step_s > 0:
            self.every = max(1, min(self.window, int(self.latency_s / step_s)))


FORWARD_HINT = ("torchrun --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2 --shutdown-timeout 120 "
                "(both flags where `torchrun --help` lists them), or srun with one task per GPU (no agent)")


def unforwarded_signals(info: runtime.DistInfo, trapped: Iterable[str]) -> list[str]:
    """The signals this run traps for a requeue that the launcher's agent (torchrun) does not forward,
    inside a Slurm job that can requeue: Slurm's --signal then reaches the agent, whose default action
    ends it, and the step's end kills this rank before its checkpoint. [] without an agent."""
    if info.agent_signals is None or not info.can_requeue:
        return []
    return [name for name in trapped if name not in info.agent_signals and name != "SIGTERM"]


def requeue_slurm_job(job_id: str) -> bool:
    """`scontrol requeue JOB_ID` (argument list, no shell); True on success."""
    exe = shutil.which("scontrol")
    if exe is None:
        log.warning("cannot requeue job %s: scontrol is not on PATH (inside a container? bind-mount it)",
                    job_id)
        return False
    # Slurm's requeue SIGTERMs every process of the job, this scontrol too: killed before it exits 0, it read as a
    # failure (a CI run: "failed: " and no reason) though the job was requeued. It starts with SIGTERM blocked (a
    # mask survives exec, unlike a handler; blocked only while the child forks, in this thread) and ends on its own.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        proc = subprocess.Popen([exe, "requeue", str(job_id)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        log.warning("scontrol requeue %s did not answer in 60 s: the job is not requeued by this run", job_id)
        return False
    if proc.returncode < 0:
        log.warning("scontrol requeue %s was stopped by %s before it answered: whether the job is requeued, "
                    "`squeue -j %s` says", job_id, signal.Signals(-proc.returncode).name, job_id)
        return False
    if proc.returncode != 0:
        log.warning("scontrol requeue %s failed (exit %d): %s", job_id, proc.returncode, err.strip())
        return False
    log.info("requeued Slurm job %s", job_id)
    return True


def signal_stop(signum: int, received_at: float | None, info: runtime.DistInfo, requeue_signals: Iterable[str],
                run_dir: str, state) -> Stop:
    """The stop of a signal the ranks agreed on: checkpointed where the run is (the fit loop), then rank 0 marks the
    run directory (slurm/common.sh reads the 143 that follows as a checkpointed stop, not a crash) and requeues the
    job under Slurm for the requeue signals; the run's result is `preempted` (exit 128 + the signal unless
    requeued). srun tasks and torchrun inside an allocation requeue here; submitit requeues through checkpoint()."""
    name = signal.Signals(signum).name
    waited = f" ({time.monotonic() - received_at:.2f} s after it reached this rank)" if received_at else ""

    def then() -> FitResult:
        if received_at is not None and info.agent_shutdown_s is not None:
            log.info("checkpoint written %.1f s after %s reached this rank (torchrun kills its workers %.0f s "
                     "after forwarding a signal)", time.monotonic() - received_at, name, info.agent_shutdown_s)
        if info.is_main:
            (Path(run_dir) / PREEMPTED_MARKER).write_text(f"{name} epoch {state.epoch} step {state.global_step}\n")
        requeued = False
        if info.is_main and (name in requeue_signals or name == info.preempt_signal) and info.can_requeue \
                and info.requeue_id:
            requeued = requeue_slurm_job(info.requeue_id)
        requeued = bool(runtime.broadcast_object(requeued, info))
        return FitResult("preempted", signum, requeued, reason=f"preempted (received {name})")

    return Stop(f"received {name}", code=128 + signum, detail=waited, then=then)

"""How an error ends a trainer process: one table from exception to exit code (trainer/launch/exitcodes.py says what
each code means to a restart loop) and the one-line message the command line prints. Every path that ends a process
reads it: the command line (trainer/cli/commands.py main), each rank's exit record (trainer/engine/session.py) and
the submitit task (hpc/task.py, through run_train).

    ending = exit_of(err)       # Ending(code, message); code 1 (CRASH): keep the traceback, print nothing
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer.config.settings import ConfigError
from trainer.data.download import DownloadError
from trainer.distributed.environment import LaunchError
from trainer.engine.ckpt_io import CheckpointError
from trainer.engine.window import NonFiniteLossError
from trainer.launch.exitcodes import (
    DONE,
    NON_FINITE,
    RESOURCE,
    UNFIT_HOST,
    USAGE,
    ResourceError,
    StragglerError,
    UnfitHostError,
    disk_error,
    is_resource_error,
)
from trainer.native.extras import MissingExtraError

CRASH = 1       # anything the table does not name: a bug or a fault a relaunch may not meet again
USAGE_ERRORS = (ConfigError, LaunchError, CheckpointError, DownloadError, ValueError, FileNotFoundError,
                MissingExtraError)


@dataclass(frozen=True)
class Ending:
    """An error's exit code and the message printed for it (none for a crash: its traceback says more)."""

    code: int
    message: str = ""


def no_deterministic_kernel(err: BaseException) -> bool:
    """torch's refusal, under train.deterministic=true, of an op with no deterministic kernel: a setting that
    fails the same at every relaunch, so a usage error."""
    return isinstance(err, RuntimeError) and "does not have a deterministic implementation" in str(err)


def unfit_hint(err: UnfitHostError) -> str:
    """How to go on without the hosts an UnfitHostError names (one line)."""
    hosts = ",".join(sorted(err.hosts))
    if isinstance(err, StragglerError):
        return (f"the restart loop (slurm/*.sbatch, MAX_RESTARTS) relaunches without it; by hand: sbatch/srun "
                f"--exclude={hosts} ... --resume auto (its checkpoint is written), or faults.straggler_action=warn to "
                f"go on with it")
    return (f"the restart loop (slurm/*.sbatch, MAX_RESTARTS) relaunches without the host; by hand: sbatch/srun "
            f"--exclude={hosts}, faults.preflight_slow=0.3 where nodes are shared with other work, or "
            f"faults.preflight=off to train on it anyway (RUN_DIR/preflight.json has the figures)")


def _resource(err: BaseException) -> str:
    return str(err) if isinstance(err, ResourceError) else str(disk_error(getattr(err, "filename", None) or "?", err))


def _deterministic(err: BaseException) -> str:
    return (f"train.deterministic=true: {str(err).split(', but you set')[0]}.\nHINT: train.deterministic=false trains "
            f"with it (a resume is then not bitwise on CUDA: docs/gpu.md)")


# (which errors, their exit code, their message): the first row that matches decides
TABLE: tuple[tuple[Callable[[BaseException], bool], int, Callable[[BaseException], str]], ...] = (
    (lambda err: isinstance(err, NonFiniteLossError), NON_FINITE, str),
    (is_resource_error, RESOURCE, _resource),
    (lambda err: isinstance(err, UnfitHostError), UNFIT_HOST, lambda err: f"{err}\nHINT: {unfit_hint(err)}"),
    (lambda err: isinstance(err, USAGE_ERRORS), USAGE, str),
    (no_deterministic_kernel, USAGE, _deterministic),
)


def exit_of(err: BaseException) -> Ending:
    """The exit code and message of an error that ends the process (CRASH and no message where no row matches)."""
    for matches, code, message in TABLE:
        if matches(err):
            return Ending(code, message(err))
    return Ending(CRASH)


def exit_code_of(result) -> int:
    """A finished run's exit code (trainer/launch/exitcodes.py): 0, 128 + the signal of a checkpointed stop that
    was not requeued, or the code of a component's stop (callbacks.Stop)."""
    if result.status == "preempted":
        return DONE if result.requeued else 128 + result.signal
    return result.code if result.code is not None else DONE


def exit_cause(err: BaseException) -> str:
    """An error as a run's exit record states its cause (the components hear the same: Component.exited)."""
    return f"{type(err).__name__}: {err}"[:2000]

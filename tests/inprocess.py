"""The command line inside the test process (issue 84 point 1): `cli(...)` runs `python -m trainer ARGS` through its
public entry (trainer.cli.main) and answers as conftest.trainer does (returncode, stdout, stderr), without a process
start and torch's import (a toy training: 0.05 s here against about 5 s as a subprocess).

    from tests.inprocess import cli
    out = cli("train", "--recipe", "toy", "--epochs", "1", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0 and "training completed" in out.stderr

For tests where the process is not what is tested: signals sent to the run, exit codes of the process itself,
launchers and ranks, os._exit paths (the hang watch), the native builds and disk faults stay subprocesses.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tests.procs import REPO, clean_env


@dataclass
class Ran:
    """What conftest.trainer's CompletedProcess gives: the exit code and the two streams."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def environment(env: dict[str, str] | None = None) -> Iterator[None]:
    """os.environ for the duration: `env` (a conftest.clean_env(...) mapping) where given, else clean_env()'s
    (no launcher or Slurm variables, the toy recipe plugged in); the environment as it was afterwards."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env if env is not None else clean_env())
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def kept_process_state() -> Iterator[None]:
    """What a run may set for its whole process, put back: the working directory, the umask (--private), torch's
    deterministic kernels (train.deterministic) and threads, the log handlers the run attached to the root logger."""
    import logging

    import torch
    cwd, umask = os.getcwd(), os.umask(0o022)
    os.umask(umask)
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        yield
    finally:
        os.chdir(cwd)
        os.umask(umask)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, "_trainer", False)]:
            root.removeHandler(handler)
            handler.close()


def cli(*args: str, env: dict[str, str] | None = None, check: bool = True, timeout: float | None = None,
        cwd: Path | None = None) -> Ran:
    """`python -m trainer ARGS` in this process, as conftest.trainer runs it (cwd: the repository unless given; env:
    a clean_env(...) mapping, default clean_env()). check: a non-zero exit raises, with the end of stderr. timeout:
    taken for conftest.trainer's signature; nothing here waits on another process."""
    from trainer.cli import main
    return entry(main, args, env=env, check=check, what="trainer", cwd=cwd)


def entry(main: Callable[[list[str]], int | None], args: tuple[str, ...] | list[str], env: dict[str, str] | None = None,
          check: bool = True, what: str = "", cwd: Path | None = None) -> Ran:
    """A command line's entry function (trainer.cli.main, hpc.submit.main) on ARGS in this process: the exit code it
    returns or raises (argparse's SystemExit), its two streams, the process's state put back after it (cwd: the
    working directory it runs in, default the repository)."""
    args = tuple(args)
    paths = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if [p for p in paths if Path(p).resolve() != REPO]:
        raise ValueError(f"cli(): PYTHONPATH={paths} is read when an interpreter starts; run this one as a process "
                         f"(tests/procs.py trainer)")
    out, err = io.StringIO(), io.StringIO()
    with environment(env), kept_process_state(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("default")             # as a fresh interpreter shows them: once per place
        os.chdir(cwd or REPO)
        if os.environ.get("OMP_NUM_THREADS"):          # the threads a subprocess of clean_env() would run on: the
            import torch  # same reduction order, so the same bits as its run
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        try:
            code = main(list(args))
        except SystemExit as stop:                     # argparse's usage errors, --help, sys.exit(message)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    ran = Ran(args, int(code or 0), out.getvalue(), err.getvalue())
    if check and ran.returncode != 0:
        raise AssertionError(f"{what or main.__module__} {' '.join(args)} exited {ran.returncode}:\n"
                             f"{ran.stderr[-4000:]}")
    return ran

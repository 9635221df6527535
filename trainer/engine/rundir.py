"""The run directory before training: claimed (one live run at a time, no fresh run over old checkpoints,
no stale temporaries) and, with --private, readable by its owner only.

    lock = claim_run_dir("runs/x", resume="auto", info=info)   # ... train ...; then lock.release()
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
from pathlib import Path

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine import ckpt_io
from trainer.launch.exitcodes import DiskError, disk_error, free_space

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"


MARKER = ".trainer-run"            # written when a run claims its directory: the directory is a run's
# put there by the suite itself: sbatch's task files, the restart loop's record (slurm/common.sh)
SUITE_FILES = re.compile(r"^(task-\d+\.out|\.lock|\.preempted|\.write-test-\d+|restarts\.jsonl)$")


RUN_FILES = re.compile(r"^(config(\.\d+)?\.yaml|train(\.rank\d+)?\.log|metrics\.jsonl|checkpoints|tb|profile|exits|"
                       r"confusion_\w+\.png)$")   # what a run writes (a directory written before MARKER existed)


def foreign_entries(run_dir: Path) -> list[str]:
    """What makes an existing directory someone else's: [] when it is new, empty, marked as a run's (MARKER), a
    run directory written before the marker existed (only a run's files, with checkpoints/, train.log or
    metrics.jsonl among them: a lone config.yaml may be the user's own), or holds only files the suite puts there
    before the trainer starts (sbatch's task-N.out)."""
    if not run_dir.exists():
        return []
    names = sorted(p.name for p in run_dir.iterdir())
    if MARKER in names:
        return []
    others = [n for n in names if not SUITE_FILES.match(n)]
    if all(RUN_FILES.match(n) for n in others) and {"checkpoints", "train.log", "metrics.jsonl"} & set(others):
        return []
    return others


def check_ownership(run_dir: Path) -> None:
    """A run writes only into a directory that is new, empty or a run's: never into a home folder or a
    repository whose config.yaml, train.log or metrics.jsonl it would replace or append to."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ckpt_io.CheckpointError(f"--run-dir {run_dir} is a file, not a directory.\nHINT: pick another "
                                      f"--run-dir (a new or empty directory).")
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ckpt_io.CheckpointError(
            f"--run-dir {run_dir} is an existing directory that is not a run directory (it holds {shown}); a run "
            f"writes config.yaml, train.log and metrics.jsonl there and would replace or append to files of "
            f"yours.\nHINT: give --run-dir a new or empty directory (e.g. {run_dir / 'run'}), or omit it "
            f"(runs/<recipe>-<job id>).")


def mark_as_run(run_dir: Path, holder: str) -> None:
    marker = run_dir / MARKER
    if not marker.exists():
        marker.write_text(f"a trainer run directory, created by {holder}\n")


class RunDirLock:
    """An exclusive flock on RUN_DIR/.lock, held by rank 0 while it trains, so that a second run into the
    same directory (another srun step of the job, a duplicate submission) is refused instead of
    interleaving checkpoints and deleting the first one's temporaries. The kernel drops the lock with its
    process, so a crash, a SIGKILL or a requeue never leaves a stale one behind."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        check_ownership(Path(run_dir))
        self.made = [p for p in (Path(run_dir), *Path(run_dir).parents) if not p.exists()]   # a refusal removes them
        check_writable(Path(run_dir))
        self.created = not self.path.exists()
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):     # e.g. ENOLCK: a file system without locks
                log.warning("cannot lock %s (%s): concurrent runs into this directory are not detected",
                            self.path, err.strerror)
                return
            other = self.path.read_text().strip() or "another process"
            self.release()
            raise ckpt_io.CheckpointError(
                f"run directory {run_dir} is in use by a live run ({other}).\nHINT: give each concurrent run "
                f"(each srun step of a sweep) its own --run-dir; the default runs/<recipe>-<job>.<step> "
                f"already differs per step.") from None

    def probe(self, holder: str) -> None:
        """Write what mark() will write, to a file of its own that goes at once: a full disk or a quota shows here,
        before anything of the run's is written (the lock's own bytes stay as they were until commit)."""
        probe = self.path.with_name(f".lock-probe-{os.getpid()}")
        try:
            probe.write_text(holder)
        finally:
            probe.unlink(missing_ok=True)

    def mark(self, holder: str) -> None:
        """Say who holds the lock (once the run is accepted: a refused run changes nothing on disk)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, holder.encode())

    def release(self, refused: bool = False) -> None:
        """Unlock (closing the descriptor does it); a refused run removes the lock file and the folders it created
        (a refusal leaves every byte as it was)."""
        if self.fd is not None:
            if refused and self.created:
                self.path.unlink(missing_ok=True)
                for folder in self.made:
                    with contextlib.suppress(OSError):      # (not empty: something else wrote there meanwhile)
                        folder.rmdir()
            os.close(self.fd)
            self.fd = None


def check_writable(run_dir: Path) -> None:
    """Create the run directory, or say clearly why this user cannot (a container's non-root user and a
    mounted directory owned by someone else, most often)."""
    target = run_dir
    while not target.exists() and target.parent != target:
        target = target.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        if not isinstance(err, PermissionError):
            raise DiskError(f"cannot create or write run directory {run_dir}: {err.strerror} ({err.filename}); "
                            f"{free_space(target)} there.\nHINT: pick a --run-dir on a writable file system with "
                            f"free space.") from None
        st = target.stat()
        raise DiskError(
            f"run directory {run_dir} is not writable by this user (uid {os.getuid()}): {target} belongs to "
            f"uid {st.st_uid}, mode {st.st_mode & 0o777:o}; {free_space(target)} there.\nHINT: in a container the "
            f"image's user is uid 1000: mount a directory it can write (chown 1000 DIR), run as yourself "
            f"(docker/podman --user $(id -u):$(id -g), apptainer does so already), or pick another --run-dir.") \
            from None


def holder_text(info: DistInfo) -> str:
    """Who holds the lock, for the message a second run gets."""
    where = "no scheduler job"
    if info.job_id:
        where = f"job {info.job_id}" + (f" step {info.step_id}" if info.step_id is not None else "")
    return f"pid {os.getpid()} on {socket.gethostname()}, {where}"


def claim_run_dir(run_dir: str | Path, resume: str, info: DistInfo) -> RunDirLock | None:
    """Before anything is written: lock the run directory (rank 0; refused while another run holds it) and refuse
    a fresh run into a run directory with checkpoints (what a run may change there waits for commit_run_dir).
    Rank 0 looks (run directories need not be shared); all ranks raise. Returns rank 0's lock."""
    problem, lock = None, None
    if info.is_main:
        try:
            lock = RunDirLock(run_dir)
            if not resume:
                ckpt_io.refuse_fresh_run(run_dir)
            lock.probe(holder_text(info))
        except ckpt_io.CheckpointError as err:
            problem = ("usage", str(err))
        except DiskError as err:                        # check_writable's
            problem = ("disk", str(err))
        except OSError as err:                          # the lock or the marker: a full or read-only disk
            problem = ("disk", str(disk_error(err.filename or run_dir, err, "run directory",
                                              "free space on it, or pick another --run-dir")))
    problem = runtime.broadcast_object(problem, info)
    if problem:
        if lock is not None:
            lock.release(refused=True)
        raise (DiskError if problem[0] == "disk" else ckpt_io.CheckpointError)(problem[1])
    return lock


def commit_run_dir(run_dir: str | Path, info: DistInfo, damaged: list[Path], lock: RunDirLock | None = None) -> None:
    """Rank 0, once nothing refused the run: mark the directory as a run's, remove the temporaries of interrupted
    saves and move the checkpoints that do not load aside (a refusal leaves all of them as they were)."""
    if not info.is_main:
        return
    if lock is not None:
        lock.mark(holder_text(info))        # who holds it, once the run is accepted
    mark_as_run(Path(run_dir), holder_text(info))
    folder = ckpt_io.CheckpointFolder(run_dir)
    folder.remove_temporaries()
    folder.set_aside_damaged(damaged)


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

"""Run directories that are not clean: stale and corrupt checkpoints, a fresh run into an old directory,
killed saves, and a disk that fills up during a checkpoint write. Nothing already saved may be lost."""
import re
import resource
import signal
import subprocess
import time

import pytest
import torch

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, record_fault, trainer, weights
from tests.inprocess import cli
from tests.timeouts import limit

RUN = ("--recipe", "toy", "--epochs", "3", "--seed", "3", "log.tensorboard=false", "ckpt.every_epochs=0",
       "ckpt.every_steps=8", "ckpt.keep_last=2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    cli("train", *RUN, "--run-dir", str(run_dir))
    return weights(run_dir)


def test_stale_corrupt_checkpoints_neither_eat_new_ones_nor_get_resumed(tmp_path, reference):
    """The case seen on main: corrupt step-800/900 in the run dir, a 24-step run that is preempted and
    requeued. The corrupt files are kept aside, every new checkpoint survives, the resume is bitwise."""
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in (800, 900):
        (ckpts / f"step-{step:08d}.pt").write_bytes(b"\0" * 4096)
    first = trainer("train", *RUN, "--run-dir", str(tmp_path / "run"), "--resume", "auto",
                    "data.signal_at_step=19", check=False)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    assert "moved aside as step-00000900.pt.corrupt" in first.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "best.pt", "step-00000016.pt", "step-00000019.pt", "step-00000800.pt.corrupt", "step-00000900.pt.corrupt"]
    second = cli("train", *RUN, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert "step-00000019.pt: epoch 2, batch 3, step 19" in second.stderr
    assert_bitwise_equal(weights(tmp_path / "run"), reference)
    record_fault("stale corrupt step-800/900 checkpoints in the run dir, then SIGTERM and requeue", steps_lost=0,
                 outcome="kept as `*.corrupt`; every new checkpoint kept; bitwise resume")


def test_fresh_run_into_an_old_run_directory_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    cli("train", *RUN, "--epochs", "1", "--run-dir", str(run_dir))
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    t0 = time.monotonic()
    again = cli("train", *RUN, "--epochs", "1", "--run-dir", str(run_dir), "--lr", "0.5", check=False)
    record_fault("fresh run (no --resume) into a run dir with checkpoints", exit_s=round(time.monotonic() - t0, 2),
                 steps_lost=0, outcome="refused, exit 2, nothing in the run dir changed")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"run directory {run_dir} already holds checkpoints (best.pt, final.pt)" in again.stderr
    assert "--resume auto" in again.stderr and "another --run-dir" in again.stderr
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_temporaries_of_a_killed_save_are_removed_at_the_next_start(tmp_path, reference):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / ".step-00000008.pt.tmp.31337").write_bytes(b"\0" * 100)
    out = cli("train", *RUN, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert "removed" in out.stderr and ".step-00000008.pt.tmp.31337" in out.stderr
    assert not list(ckpts.glob(".*tmp*"))
    assert_bitwise_equal(weights(tmp_path / "run"), reference)


def _file_size_limit(size: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


def test_a_full_disk_before_the_first_checkpoint_is_one_line_and_final(tmp_path):
    """Issue 57: the run directory's lock/marker write fails (RLIMIT_FSIZE 0: every write past byte 0 fails as a
    full disk would): one line naming the path, the error and the free space, exit 4, which the restart loop never
    relaunches (was: a traceback and exit 1, retryable)."""
    t0 = time.monotonic()
    proc = subprocess.run([PY, "-m", "trainer", "train", *RUN, "--epochs", "1", "--run-dir", str(tmp_path / "run")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("runs"),
                          preexec_fn=_file_size_limit(0))
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and re.search(r"could not write run directory .*run.*: File too large \(errno EFBIG\); "
                                         r"[\d.]+ [GM]iB free there", error[0]), proc.stderr[-2000:]
    record_fault("a full disk before the first checkpoint (the run directory's lock)", steps_lost=0,
                 exit_s=round(time.monotonic() - t0, 2), outcome="exit 4 (resource, never relaunched), one line "
                 "naming the path, the error and the free space (was: a traceback, exit 1, retryable)")


def test_a_full_disk_during_a_checkpoint_write_is_an_error_naming_the_file(tmp_path):
    """RLIMIT_FSIZE makes the write fail as a full disk or quota would; the earlier checkpoint survives."""
    run_dir = tmp_path / "run"
    big = ("model.hidden=2048", "ckpt.every_epochs=1", "ckpt.every_steps=0")    # ~200 KB of weights + Adam
    cli("train", *RUN, *big, "--epochs", "1", "--run-dir", str(run_dir))
    saved = {p: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    assert sorted(p.name for p in saved) == ["best.pt", "final.pt"] and min(map(len, saved.values())) > 150_000
    t0 = time.monotonic()
    proc = subprocess.run([PY, "-m", "trainer", "train", *RUN, *big, "--epochs", "3", "--run-dir", str(run_dir),
                           "--resume", "auto"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("runs"), preexec_fn=_file_size_limit(100_000))
    assert proc.returncode == 4, proc.stderr[-3000:]          # resource: never relaunched (exitcodes.py)
    assert "Traceback" not in proc.stderr
    # the first write after the resume: the improved validation metric's best.pt
    assert re.search(rf"could not write checkpoint {re.escape(str(run_dir))}/checkpoints/best.pt: File too large "
                     rf"\(errno EFBIG\); [\d.]+ [GM]iB free there", proc.stderr)
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == saved
    assert torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True)["global_step"] == 8
    record_fault("disk full / file too large while writing a checkpoint", exit_s=round(time.monotonic() - t0, 2),
                 steps_lost=8, outcome="exit 4 (resource) naming the file and the free space; earlier checkpoints "
                 "intact (steps since the "
                 "last written checkpoint are lost)")
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))

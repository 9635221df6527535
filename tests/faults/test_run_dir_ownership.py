"""A run writes only into a directory that is new, empty or a run's (issue 46, point 4): a home folder or a
repository given as --run-dir is refused before a byte is written, as are a file and an unwritable place."""
import time

import pytest

from tests.conftest import record_fault
from tests.inprocess import cli
from trainer.engine.rundir import MARKER

RUN = ("train", "--recipe", "toy", "--epochs", "1", "--seed", "1", "log.tensorboard=false")


def listing(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*"))


@pytest.mark.parametrize("theirs", [("config.yaml", "notes.txt"), ("config.yaml",)])
def test_a_directory_of_the_users_own_files_is_refused_untouched(tmp_path, theirs):
    home = tmp_path / "home"
    home.mkdir()
    for name in theirs:
        (home / name).write_text("my own\n")
    before = listing(home)
    t0 = time.monotonic()
    for extra in ((), ("--resume", "auto")):
        out = cli(*RUN, "--run-dir", str(home), *extra, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"--run-dir {home} is an existing directory that is not a run directory (it holds " \
               f"{', '.join(theirs)})" in out.stderr
        assert listing(home) == before
        if not extra and len(theirs) > 1:
            record_fault("--run-dir an existing directory of the user's own files", steps_lost=0,
                         exit_s=round(time.monotonic() - t0, 2), outcome="exit 2 naming it, nothing written")


def test_a_file_and_an_unwritable_place_get_one_line_errors(tmp_path):
    afile = tmp_path / "results.csv"
    afile.write_text("a,b\n")
    out = cli(*RUN, "--run-dir", str(afile), check=False)
    assert out.returncode == 2 and f"--run-dir {afile} is a file, not a directory" in out.stderr
    out = cli(*RUN, "--run-dir", "/proc/no-such-run", check=False)
    assert out.returncode == 4 and "Traceback" not in out.stderr          # resource: never relaunched
    assert "cannot create or write run directory /proc/no-such-run" in out.stderr


@pytest.mark.parametrize("kind", ["new", "empty", "task logs only", "a run before the marker",
                                  "checkpoints copied in"])
def test_directories_that_are_ours_are_accepted(tmp_path, kind):
    run_dir, epochs, resume = tmp_path / "run", "1", ()
    if kind != "new":
        run_dir.mkdir()
    if kind == "task logs only":                    # sbatch's PER_TASK_LOGS=1 writes these before the trainer
        (run_dir / "task-0.out").write_text("job 1 restart 0\n")
    if kind == "a run before the marker":           # today's run directories: config.yaml beside checkpoints/
        cli(*RUN, "--run-dir", str(run_dir))
        (run_dir / MARKER).unlink()
        epochs, resume = "2", ("--resume", "auto")
    if kind == "checkpoints copied in":           # a run's checkpoints/ moved to a new directory, then resumed
        cli(*RUN, "--run-dir", str(tmp_path / "old"))
        (tmp_path / "old" / "checkpoints").rename(run_dir / "checkpoints")
        epochs, resume = "2", ("--resume", "auto")
    out = cli(*RUN[:3], "--epochs", epochs, *RUN[5:], "--run-dir", str(run_dir), *resume, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (run_dir / MARKER).exists() and (run_dir / "checkpoints" / "final.pt").exists()

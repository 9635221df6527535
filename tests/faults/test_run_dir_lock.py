"""One live run per run directory (issue 19, point 10): a second run into a directory another live run
holds is refused, naming the holder; the lock goes with its process (a SIGKILL leaves none behind)."""
import signal
import subprocess
import time

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.rundir import LOCK_NAME

SLOW = ("train", "--recipe", "toy", "--seed", "5", "log.tensorboard=false", "--batch-size", "16",
        "--epochs", "50", "data.step_sleep=0.05")


def test_a_second_run_into_a_live_run_directory_is_refused_and_the_lock_dies_with_its_process(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen([PY, "-m", "trainer", *SLOW, "--run-dir", str(run_dir)], cwd=REPO,
                             env=clean_env(SLURM_JOB_ID="4242", SLURM_STEP_ID="3", SLURM_PROCID="0", SLURM_LOCALID="0",
                                           SLURM_NTASKS="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + limit("minute")
        while not (run_dir / "config.yaml").exists():
            assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
            time.sleep(0.05)
        second = cli(*SLOW, "--run-dir", str(run_dir), "--resume", "auto", check=False, timeout=limit("minute"))
        assert second.returncode == 2
        assert f"run directory {run_dir} is in use by a live run (pid {first.pid} on " in second.stderr
        assert "job 4242 step 3" in second.stderr and "HINT" in second.stderr
        assert first.poll() is None                       # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=limit("short"))
    assert (run_dir / LOCK_NAME).exists()                 # left behind, but unlocked: no stale lock
    resumed = cli(*SLOW[:-3], "--epochs", "1", "--run-dir", str(run_dir), "--resume", "auto", check=False)
    assert "in use by a live run" not in resumed.stderr

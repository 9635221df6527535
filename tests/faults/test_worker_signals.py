"""Preemption signals reach DataLoader workers too (Slurm signals every process of a task): with
train.num_workers=2 a USR1/TERM mid-epoch still ends in the agreed checkpoint and a bitwise resume.
Seen on main: torch's worker died on a SIGTERM not sent by its parent and the rank raised
"DataLoader worker (pid N) is killed by signal: Terminated" instead of checkpointing."""
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, record_fault, run_ranks, slurm_env, weights
from tests.slurm.test_cluster import TOY, sbatch, trainer_cmd, wait_job

ARGS = (*TOY, "--epochs", "3", "train.num_workers=2", "ckpt.every_steps=4", "data.step_sleep=0.05")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    run_ranks(2, "train", *ARGS, "--run-dir", str(run_dir), timeout=240)
    return weights(run_dir)


def torchrun(*args):
    return [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer", "train", *args]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_signal_to_ranks_and_their_workers_under_torchrun(tmp_path, reference, name):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(torchrun(*ARGS, "--run-dir", str(run_dir)), cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint written"
        time.sleep(0.05)
    ranks = psutil.Process(proc.pid).children()
    workers = [w for r in ranks for w in r.children(recursive=True)]
    assert len(ranks) == 2 and len(workers) >= 2, (ranks, workers)
    t0 = time.monotonic()
    for p in ranks + workers:               # as Slurm does: every process of the task, from outside
        os.kill(p.pid, getattr(signal, name))
    _, err = proc.communicate(timeout=180)
    exit_s = time.monotonic() - t0
    assert "killed by signal" not in err, err[-3000:]
    stopped = re.search(rf"received {name}: checkpointing at epoch \d+ step (\d+)", err)
    assert stopped, err[-3000:]
    assert f"exitcode  : {128 + getattr(signal, name)}" in err          # torchrun's summary of the ranks
    resumed = subprocess.run(torchrun(*ARGS, "--run-dir", str(run_dir), "--resume", "auto"), cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{int(stopped.group(1)):08d}.pt" in resumed.stderr
    assert_bitwise_equal(weights(run_dir), reference)
    record_fault(f"{name} to both ranks and their loader workers (torchrun, num_workers=2)",
                 exit_s=round(exit_s, 2), steps_lost=0, outcome="agreed checkpoint, bitwise resume")


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["USR1", "scontrol requeue"])
def test_preempting_a_job_step_with_loader_workers_requeues_and_resumes(slurm_cluster, tmp_path, reference, how):
    """USR1 (the time-limit warning: the trainer requeues itself) or `scontrol requeue` (SIGTERM to every
    process of the step, then Slurm restarts the job)."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    script = "srun " + trainer_cmd("train", *ARGS, "--run-dir", str(run_dir), "--resume", "auto")
    job = sbatch(slurm_cluster, script, "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", "--requeue",
                 "--open-mode=append", "-o", str(out))
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.1)
    # every process of the step (both ranks and their loader workers) gets the signal
    command = ["scancel", "--signal=USR1", job] if how == "USR1" else ["scontrol", "requeue", job]
    t0 = time.monotonic()
    subprocess.run(command, env=slurm_env(slurm_cluster), check=True)
    name = "SIGUSR1" if how == "USR1" else "SIGTERM"
    checkpointed = None
    while checkpointed is None and time.monotonic() - t0 < 120:
        log = out.read_text()
        if re.search(rf"received {name}: checkpointing[^\n]*\n(.*\n)*.*saved periodic checkpoint", log):
            checkpointed = time.monotonic() - t0
        time.sleep(0.05)
    info = wait_job(slurm_cluster, job, timeout=300, restarts=1)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert "killed by signal" not in text and f"received {name}: checkpointing" in text
    assert re.search(r"resumed from \S+step-(\d+)\.pt", text)
    assert_bitwise_equal(weights(run_dir), reference)
    assert checkpointed is not None
    record_fault(f"{how} of a 2-node srun job step with loader workers (num_workers=2)", steps_lost=0,
                 exit_s=round(checkpointed, 2),
                 outcome="agreed checkpoint (time: signal to checkpoint written), Slurm restarts the job, "
                         "bitwise resume")

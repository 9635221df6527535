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
from tests.timeouts import limit

# long CPU work (2-rank torchrun runs with loader workers, each resumed): tests/run.sh runs the module in the cluster
# half, beside the slurm tests here, which share the module's reference run (one run, not one per half)
pytestmark = pytest.mark.long
ARGS = (*TOY, "--epochs", "3", "train.num_workers=2", "ckpt.every_steps=4", "data.step_sleep=0.05")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    run_ranks(2, "train", *ARGS, "--run-dir", str(run_dir), timeout=limit("start"))
    return weights(run_dir)


def torchrun(*args, agent=()):
    return [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", *agent, "-m", "trainer", "train", *args]


FORWARD_USR = ("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2")


def resume_bitwise(run_dir, step: int, reference) -> None:
    """--resume auto under torchrun starts from the signal checkpoint and ends on the reference weights."""
    resumed = subprocess.run(torchrun(*ARGS, "--run-dir", str(run_dir), "--resume", "auto"), cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=limit("start"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{step:08d}.pt" in resumed.stderr
    assert_bitwise_equal(weights(run_dir), reference)


def start_and_wait_for_a_checkpoint(cmd, run_dir, env=None):
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + limit("run")
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint written"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_signal_to_ranks_and_their_workers_under_torchrun(tmp_path, reference, name):
    run_dir = tmp_path / "run"
    proc = start_and_wait_for_a_checkpoint(torchrun(*ARGS, "--run-dir", str(run_dir)), run_dir)
    ranks = psutil.Process(proc.pid).children()
    workers = [w for r in ranks for w in r.children(recursive=True)]
    assert len(ranks) == 2 and len(workers) >= 2, (ranks, workers)
    t0 = time.monotonic()
    for p in ranks:                         # as Slurm does: every process of the task, from outside
        os.kill(p.pid, getattr(signal, name))
    signalled = 0
    for w in workers:                       # a worker may have ended since it was listed (its epoch did): as Slurm,
        try:                                # which signals what is there at that instant, skip it
            os.kill(w.pid, getattr(signal, name))
            signalled += 1
        except ProcessLookupError:
            pass
    assert signalled >= 1, workers
    _, err = proc.communicate(timeout=limit("runs"))
    exit_s = time.monotonic() - t0
    assert "killed by signal" not in err, err[-3000:]
    stopped = re.search(rf"received {name}: checkpointing at epoch \d+ step (\d+)", err)
    assert stopped, err[-3000:]
    assert f"exitcode  : {128 + getattr(signal, name)}" in err          # torchrun's summary of the ranks
    resume_bitwise(run_dir, int(stopped.group(1)), reference)
    record_fault(f"{name} to both ranks and their loader workers (torchrun, num_workers=2)",
                 exit_s=round(exit_s, 2), steps_lost=0, outcome="agreed checkpoint, bitwise resume")


@pytest.mark.parametrize("name,agent,shutdown_s", [
    ("SIGTERM", (), 30),
    ("SIGUSR1", (*FORWARD_USR, "--shutdown-timeout", "90"), 90),
])
def test_a_signal_to_the_torchrun_agent_alone_ends_in_a_checkpoint_and_a_bitwise_resume(tmp_path, reference, name,
                                                                                      agent, shutdown_s):
    """pytorch #119856: torchrun forwards SIGTERM (and, with --signals-to-handle, USR1/USR2) to its workers
    and SIGKILLs them --shutdown-timeout s later (30 by default); the workers checkpoint inside that."""
    run_dir = tmp_path / "run"
    proc = start_and_wait_for_a_checkpoint(torchrun(*ARGS, "--run-dir", str(run_dir), agent=agent), run_dir)
    t0 = time.monotonic()
    os.kill(proc.pid, getattr(signal, name))            # the agent only, as srun's signal to its task
    _, err = proc.communicate(timeout=limit("run"))
    stopped = re.search(rf"received {name}: checkpointing at epoch \d+ step (\d+)", err)
    assert stopped, err[-3000:]
    written = re.search(rf"checkpoint written ([\d.]+) s after {name} reached this rank \(torchrun kills its "
                        rf"workers {shutdown_s} s after", err)
    assert written and float(written.group(1)) < shutdown_s, err[-3000:]
    assert "exitcode  : -9" not in err                   # no worker needed torchrun's SIGKILL
    resume_bitwise(run_dir, int(stopped.group(1)), reference)
    record_fault(f"{name} to the torchrun agent only (it forwards; shutdown limit {shutdown_s} s)",
                 exit_s=round(time.monotonic() - t0, 2), steps_lost=0, outcome="agreed checkpoint, bitwise resume")


def test_a_shutdown_limit_shorter_than_a_step_and_a_checkpoint_is_named_and_real(tmp_path):
    """--shutdown-timeout 0: torchrun SIGKILLs its workers right after forwarding SIGTERM. The run says so
    after its first checkpoint, and a SIGTERM then indeed ends without the signal checkpoint."""
    run_dir = tmp_path / "run"
    proc = start_and_wait_for_a_checkpoint(torchrun(*ARGS, "--run-dir", str(run_dir),
                                                    agent=("--shutdown-timeout", "0")), run_dir)
    time.sleep(1)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=limit("run"))
    assert re.search(r"a step plus a checkpoint take [\d.]+ s here, but torchrun kills its workers 0 s after", err)
    assert "HINT: torchrun --signals-to-handle" in err and "--shutdown-timeout" in err
    assert "checkpoint written" not in err               # the workers died before their checkpoint


def test_requeue_signals_torchrun_does_not_forward_are_named_at_start(tmp_path):
    """Inside a Slurm job (which can requeue), USR1/USR2 reach torchrun's agent too; without
    --signals-to-handle they end it, and the step with it, before the checkpoint: said before step 1."""
    env = clean_env(SLURM_JOB_ID="77", SLURM_PROCID="0")
    proc = subprocess.run(torchrun(*TOY, "--run-dir", str(tmp_path / "run"), "train.max_steps=1"), cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchrun forwards only SIGTERM,SIGINT,SIGHUP,SIGQUIT to its workers: SIGUSR1,SIGUSR2" in proc.stderr
    quiet = subprocess.run(torchrun(*TOY, "--run-dir", str(tmp_path / "run2"), "train.max_steps=1", agent=FORWARD_USR),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=limit("run"))
    assert quiet.returncode == 0 and "torchrun forwards only" not in quiet.stderr, quiet.stderr[-3000:]


@pytest.mark.slurm
@pytest.mark.parametrize("how", ["USR1", "scontrol requeue"])
def test_preempting_a_job_step_with_loader_workers_requeues_and_resumes(slurm_cluster, tmp_path, reference, how):
    """USR1 (the time-limit warning: the trainer requeues itself) or `scontrol requeue` (SIGTERM to every
    process of the step, then Slurm restarts the job)."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    script = "srun " + trainer_cmd("train", *ARGS, "--run-dir", str(run_dir), "--resume", "auto")
    job = sbatch(slurm_cluster, script, "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", "--requeue",
                 "--open-mode=append", "-o", str(out))
    deadline = time.monotonic() + limit("run")
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
    info = wait_job(slurm_cluster, job, timeout=limit("long"), restarts=1)
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


def _root_cause(stderr: str) -> str:
    return stderr[stderr.index("Root Cause"):]


@pytest.mark.parametrize("how,extra,cause", [
    # an unhandled exception in one worker, before the rendezvous
    ("crash", {"TOY_FAIL_RANK": "1"}, "RuntimeError: toy: rank 1 fails before the rendezvous"),
    # an error the trainer handles (message, exit 1) on every rank
    ("diverged", {}, "NonFiniteLossError: non-finite loss at step 3"),
])
def test_torchruns_failure_summary_names_the_root_cause(tmp_path, how, extra, cause):
    """Without the elastic error file torchrun's summary says only "exitcode : 1" and "To enable traceback
    see ..."; the trainer writes it (as the `record` decorator does), handled errors included."""
    args = [*TOY, "--run-dir", str(tmp_path / "run")] + (["data.nan_at_step=3", "data.nan_rank=1"]
                                                         if how == "diverged" else [])
    proc = subprocess.run(torchrun(*args), cwd=REPO, env=clean_env(**extra), capture_output=True, text=True,
                          timeout=limit("run"))
    assert proc.returncode != 0
    root = _root_cause(proc.stderr)
    assert cause in root and "To enable traceback" not in root, proc.stderr[-3000:]
    assert re.search(r"error_file: \S+error\.json", root)


def test_loader_workers_and_their_fork_server_end_with_a_training_process_killed_outright(tmp_path):
    """Seen on main: a rank SIGKILLed under torchrun left its loader worker and the fork server (which waits for
    its workers) running for good; they held the launcher's pipes, so `subprocess.run(torchrun ...)` never returned."""
    code = ("import os, signal, sys, torch\n"
            "from trainer.engine.loader import make_loader\n"
            "data = torch.utils.data.TensorDataset(torch.arange(64.0))\n"
            "loader = make_loader(data, range(64), 8, 1, None, seed=0)\n"
            "it = iter(loader); next(it)\n"
            "print(' '.join(str(c.pid) for c in __import__('psutil').Process().children(recursive=True)), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.Popen([PY, "-c", code], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, text=True)
    own = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]     # fork server, worker, tracker
    proc.wait(timeout=limit("minute"))
    assert proc.returncode == -signal.SIGKILL
    assert any("forkserver" in cmdline(p) for p in own) and len(own) >= 2, own
    deadline = time.monotonic() + limit("short")
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in own):
        time.sleep(0.2)
    alive = [p.pid for p in own if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    if alive:
        for p in alive:
            os.kill(p, signal.SIGKILL)
    assert not alive, f"still running 15 s after the training process died: {alive}"
    assert proc.stdout.read() == ""         # EOF: no process holds the pipe any more


def cmdline(p: psutil.Process) -> str:
    """A process's command line, "" where it has exited already (a zombie until its parent reaps it: seen in CI)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""

"""On the real local Slurm cluster: doctor across nodes, a 4-rank batch job, requeue and resume,
fake-GPU allocations, and a plain `python` under sbatch."""
import json
import re
import shlex
import subprocess
import time

import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, launch_ranks, slurm_env, wait_all, weights
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

pytestmark = pytest.mark.slurm
TOY = ("--recipe", "toy", "--seed", "5", "log.tensorboard=false", "--batch-size", "16")


def srun(conf, *args, timeout=limit("run")):
    return subprocess.run(["srun", *args], cwd=REPO, env=slurm_env(conf), text=True, capture_output=True,
                          timeout=timeout)


def sbatch(conf, script: str, *opts: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *opts, "--wrap", script], cwd=REPO, env=slurm_env(conf),
                         text=True, capture_output=True, check=True, timeout=limit("minute")).stdout
    return out.strip().split(";")[0]


def job_info(conf, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=slurm_env(conf), text=True,
                         capture_output=True, timeout=limit("short")).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(conf, job: str, timeout: float = limit("start"), restarts: int = 0) -> dict[str, str]:
    """Wait for a terminal state (after `restarts` requeues)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(conf, job)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") \
                and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=slurm_env(conf))
    raise AssertionError(f"job {job} did not finish in {timeout}s: {job_info(conf, job)}")


def trainer_cmd(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in (PY, "-m", "trainer", *args))


def test_doctor_across_two_nodes(slurm_cluster):
    proc = srun(slurm_cluster, "-N2", "--ntasks-per-node=2", PY, "-m", "trainer", "doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    assert report["launcher"] == "slurm" and report["world_size"] == 4
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["slurmd_nodename"] for r in ranks] == ["node1", "node1", "node2", "node2"]
    assert len({(r["master_addr"], r["master_port"]) for r in ranks}) == 1 and ranks[0]["master_addr"] == "node1"
    assert report["allreduce"]["allreduce_ok"] and report["allreduce"]["allreduce_sum"] == 10.0
    assert report["allreduce"]["via"] == "shared memory"     # the two slurmd "nodes" are one host here
    assert {c["check"]: c["level"] for c in report["checks"]}["scontrol reachable"] == "ok"


def test_fake_gpus_bind_per_task_and_fall_back_to_gloo(slurm_cluster):
    proc = srun(slurm_cluster, "-N1", "-n2", "--gpus-per-task=1", PY, "-m", "trainer", "doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    visible = [r["cuda_visible_devices"] for r in report["ranks"]]
    assert all(v is not None and len(v.split(",")) == 1 for v in visible)       # one GPU bound per task
    assert {r["device"] for r in report["ranks"]} == {"cpu"} and {r["backend"] for r in report["ranks"]} == {"gloo"}
    assert "CUDA is not usable" in proc.stderr


GPU_LAYOUTS = [  # srun options -> the fake GPU each rank drives, in rank order
    (("-N1", "-n2", "--gpus-per-node=4"), ["0", "1"]),                          # all visible to all tasks
    (("-N1", "-n2", "--gpus-per-task=2"), ["0", "2"]),                          # subsets: the model on the first
    (("-N1", "-n2", "--gpus-per-node=4", "--gpu-bind=map_gpu:2,3"), ["2", "3"]),
    (("-N2", "--ntasks-per-node=2", "--gpus-per-node=2"), ["0", "1", "0", "1"]),  # per node, not per host
]


@pytest.mark.parametrize("opts,gpus", GPU_LAYOUTS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_each_rank_drives_its_own_fake_gpu_in_every_slurm_layout(slurm_cluster, opts, gpus):
    proc = srun(slurm_cluster, *opts, PY, "-m", "trainer", "doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert [r["gpu"] for r in sorted(report["ranks"], key=lambda r: r["rank"])] == gpus


def test_two_tasks_bound_to_one_gpu_fail_fast_with_hint(slurm_cluster):
    # --gpu-bind=single:2 gives tasks 0,1 GPU 0 and tasks 2,3 GPU 1: NCCL would refuse the duplicate GPU
    proc = srun(slurm_cluster, "-N1", "-n4", "--gpus-per-node=2", "--gpu-bind=single:2",
                PY, "-m", "trainer", "doctor")
    assert proc.returncode != 0
    assert "2 tasks on this node but only 1 visible GPU(s)" in proc.stdout and "HINT" in proc.stdout


def test_plain_python_in_batch_script_is_refused(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = sbatch(slurm_cluster, trainer_cmd("train", *TOY, "--run-dir", str(tmp_path / "run")),
                 "-n4", "-o", str(out))
    info = wait_job(slurm_cluster, job, timeout=limit("run"))
    assert info["JobState"] == "FAILED"
    text = out.read_text()
    assert "without srun" in text and "HINT" in text


def test_four_rank_batch_job_completes(slurm_cluster, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = sbatch(slurm_cluster, "srun " + trainer_cmd("train", *TOY, "--epochs", "2", "--run-dir", str(run_dir)),
                 "-N2", "--ntasks-per-node=2", "-o", str(out))
    info = wait_job(slurm_cluster, job)
    assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
    ckpt = __import__("torch").load(run_dir / "checkpoints" / "final.pt", weights_only=True)
    assert ckpt["world_size"] == 4 and len(ckpt["rng"]) == 4 and ckpt["global_step"] == 2 * 4
    rows = read_metrics(run_dir)
    assert {"val", "test"} <= {r["split"] for r in rows}
    assert "world=4" in (run_dir / "train.log").read_text()
    # accounting is up (submitit's state watcher relies on sacct); slurmdbd records the end a moment after
    # slurmctld, so a few seconds of RUNNING there are expected
    deadline = time.monotonic() + limit("short")
    while True:
        acct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State,NNodes,NTasks"], text=True,
                              env=slurm_env(slurm_cluster), capture_output=True, timeout=limit("short")).stdout
        if not acct.startswith(("RUNNING", "COMPLETING", "PENDING")) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert acct.splitlines()[0].startswith("COMPLETED|2")


@pytest.mark.parametrize("how", ["scontrol requeue", "USR1"])
def test_requeued_job_resumes_to_the_same_weights(slurm_cluster, tmp_path, how):
    """`scontrol requeue` (Slurm sends SIGTERM, then restarts the job), or a USR1 time-limit warning
    (the trainer checkpoints and requeues itself): restart count 1, resumed, same final weights."""
    args = (*TOY, "--epochs", "6", "ckpt.every_steps=4", "data.step_sleep=0.15")
    # the uninterrupted reference (same world size) trains while the job runs: the job mostly sleeps
    ref = launch_ranks(2, "train", *args, "--run-dir", str(tmp_path / "ref"))
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    script = "srun " + trainer_cmd("train", *args, "--run-dir", str(run_dir), "--resume", "auto")
    job = sbatch(slurm_cluster, script, "-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                 "-o", str(out))
    deadline = time.monotonic() + limit("run")
    while not list((run_dir / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline, f"no checkpoint written: {out.read_text() if out.exists() else ''}"
        time.sleep(0.2)
    if how == "USR1":
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env(slurm_cluster), check=True)
    else:
        subprocess.run(["scontrol", "requeue", job], env=slurm_env(slurm_cluster), check=True)
    info = wait_job(slurm_cluster, job, timeout=limit("long"), restarts=1)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert "restart 1 of job" in text            # DistInfo.restart_count, from SLURM_RESTART_COUNT
    resumed = re.search(r"resumed from \S+step-(\d+)\.pt", text)
    assert resumed and int(resumed.group(1)) > 0, text[-3000:]
    if how == "USR1":
        assert "received SIGUSR1" in text and f"requeued Slurm job {job}" in text
    for rank, (code, err) in enumerate(wait_all(ref)):
        assert code == 0, f"reference rank {rank} exited {code}:\n{err[-3000:]}"
    assert_bitwise_equal(weights(run_dir), weights(tmp_path / "ref"))


def test_two_concurrent_srun_steps_of_one_allocation_differ_in_port_and_run_dir(slurm_cluster, tmp_path):
    """A sweep's two srun steps side by side on one node: each forms its own process group (the port is
    derived from job and step id: the same port would fail the second rendezvous) and writes its own
    default run directory (runs/toy-JOB and runs/toy-JOB.1), and a third step aimed at a live step's
    run directory is refused."""
    cmd = trainer_cmd("train", *TOY, "--epochs", "5", "data.step_sleep=0.2")
    step = "( date +%s.%N > {n}.t0; srun -n2 --exact " + cmd + " > {n}.log 2>&1; echo $? > {n}.rc; " \
        "date +%s.%N > {n}.t1 ) &"
    third = "srun -n1 --overlap " + trainer_cmd("train", *TOY, "--resume", "auto") + \
        ' --run-dir "runs/toy-$SLURM_JOB_ID" > c.log 2>&1; echo $? > c.rc'  # the shell expands the job id
    script = "\n".join([step.format(n="a"), "sleep 1", step.format(n="b"),
                        "until [ -f runs/toy-$SLURM_JOB_ID/config.yaml ]; do sleep 0.2; done", third, "wait"])
    job = sbatch(slurm_cluster, script, "-N1", "-n4", "--cpus-per-task=1", "-D", str(tmp_path),
                 "-o", str(tmp_path / "job.out"))
    info = wait_job(slurm_cluster, job, timeout=limit("start"))
    read = lambda name: (tmp_path / name).read_text().strip()  # noqa: E731
    logs = read("a.log") + read("b.log")
    assert info["JobState"] == "COMPLETED" and read("a.rc") == read("b.rc") == "0", logs[-3000:]
    t0a, t1a, t0b, t1b = (float(read(f"{n}.{t}")) for n in "ab" for t in ("t0", "t1"))
    assert t0b < t1a and t0a < t1b                          # the two steps ran at the same time
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == [f"toy-{job}", f"toy-{job}.1"], runs
    assert all((tmp_path / "runs" / r / "checkpoints" / "final.pt").exists() for r in runs)
    assert read("c.rc") == "2" and "is in use by a live run (pid " in read("c.log"), read("c.log")


def test_steps_smaller_than_their_allocation_train(slurm_cluster, tmp_path):
    """Inside -N2 --ntasks-per-node=4 every step inherits SLURM_NTASKS_PER_NODE=4; `srun -n1`, `srun -N1 -n2` and
    `srun -N2 -n2` are steps of their own size (Slurm lets -n win), and were refused before (issue 68)."""
    steps = {"n1": "-n1", "N1n2": "-N1 -n2", "N2n2": "-N2 -n2"}
    script = "\n".join(f"srun {opts} " + trainer_cmd("train", *TOY, "--epochs", "1", "--run-dir",
                                                     str(tmp_path / name)) + f" > {tmp_path / name}.log 2>&1"
                       for name, opts in steps.items())
    script += "\nsrun -N2 -n2 " + trainer_cmd("doctor", "--json") + f" > {tmp_path}/doctor.log 2>&1"
    job = sbatch(slurm_cluster, script, "-N2", "--ntasks-per-node=4", "-o", str(tmp_path / "job.out"))
    assert wait_job(slurm_cluster, job,
                    timeout=limit("long"))["JobState"] == "COMPLETED", (tmp_path / "job.out").read_text()
    for name, world in (("n1", 1), ("N1n2", 2), ("N2n2", 2)):
        log = (tmp_path / f"{name}.log").read_text()
        assert f"world={world}" in (tmp_path / name / "train.log").read_text(), log[-2000:]
        assert (tmp_path / name / "checkpoints" / "final.pt").exists()
    report = json.loads(next(line for line in (tmp_path / "doctor.log").read_text().splitlines()
                             if line.startswith("{")))
    assert report["world_size"] == 2 and sorted(r["slurmd_nodename"] for r in report["ranks"]) == ["node1", "node2"]


def test_an_salloc_shell_of_several_tasks_stops_naming_srun(slurm_cluster, tmp_path):
    proc = subprocess.run(["salloc", "-N1", "-n2", PY, "-m", "trainer", "train", *TOY, "--run-dir",
                           str(tmp_path / "run")], cwd=REPO, env=slurm_env(slurm_cluster), text=True,
                          capture_output=True, timeout=limit("run"))
    assert proc.returncode == 2 and "SLURM_NTASKS=2" in proc.stderr and "srun python -m trainer" in proc.stderr
    assert not (tmp_path / "run").exists()

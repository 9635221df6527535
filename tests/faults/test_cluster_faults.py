"""Faults on the real local Slurm cluster: one task of a job array preempted, a rank dying under submitit."""
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_bitwise_equal, record_fault, slurm_env, trainer, weights
from tests.slurm.test_cluster import TOY, job_info, trainer_cmd, wait_job
from tests.timeouts import limit

pytestmark = pytest.mark.slurm


def test_preempting_the_array_task_that_holds_the_array_id_requeues_that_task_only(slurm_cluster, tmp_path):
    """Seen on main: rank 0 ran `scontrol requeue $SLURM_JOB_ID`; for the one task whose job id is the
    array's own id (here the last task started, task 2; the issue saw task 0) that requeues every task."""
    args = (*TOY, "--epochs", "3", "ckpt.every_steps=4", "data.step_sleep=0.1")
    trainer("train", *args, "--run-dir", str(tmp_path / "ref"))                 # uninterrupted, world 1
    script = trainer_cmd("train", *args, "--resume", "auto") + f' --run-dir "{tmp_path}/run-$SLURM_ARRAY_TASK_ID"'
    out = subprocess.run(["sbatch", "--parsable", "--array=0-2", "-N1", "--ntasks-per-node=1", "--requeue",
                          "--open-mode=append", "-o", str(tmp_path / "task-%a.out"), "--wrap", "srun " + script],
                         env=slurm_env(slurm_cluster), text=True, capture_output=True, check=True,
                         timeout=limit("minute"))
    array = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + limit("run")
    target = None
    while target is None or not list((tmp_path / f"run-{target}" / "checkpoints").glob("step-*.pt")):
        assert time.monotonic() < deadline, [job_info(slurm_cluster, f"{array}_{t}") for t in range(3)]
        ids = {t: job_info(slurm_cluster, f"{array}_{t}").get("JobId") for t in range(3)}
        target = next((t for t, job_id in ids.items() if job_id == array), None)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", f"{array}_{target}"], env=slurm_env(slurm_cluster), check=True)
    infos = [wait_job(slurm_cluster, f"{array}_{t}", timeout=limit("long"),
                      restarts=int(t == target)) for t in range(3)]
    logs = [(tmp_path / f"task-{t}.out").read_text() for t in range(3)]
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 3, logs[target][-3000:]
    counts = [int(i["Restarts"]) for i in infos]
    assert counts == [int(t == target) for t in range(3)], (target, counts)    # 1, 0, 0 with the target first
    assert f"requeued Slurm job {array}_{target}" in logs[target] and "restart 1 of job" in logs[target]
    assert re.search(rf"resumed from \S+/run-{target}/checkpoints/step-\d+\.pt", logs[target])
    others = [log for t, log in enumerate(logs) if t != target]
    assert not any("resumed from" in log or "received SIGUSR1" in log for log in others)
    for t in range(3):   # the preempted task's final weights equal the uninterrupted run's, the others' too
        assert_bitwise_equal(weights(tmp_path / f"run-{t}"), weights(tmp_path / "ref"))
    record_fault("USR1 to the array task that holds the array's job id (3-task array)", steps_lost=0,
                 outcome="only that task requeued (restarts 1, 0, 0), bitwise resume")


def _listening(pid: int) -> list[str]:
    """Local addresses (hex ip:port as in /proc/net/tcp*) of the TCP sockets pid listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:     # 0A: LISTEN
                found.append(parts[1])
    return found


def test_the_local_cluster_is_private_and_listens_on_loopback_only(slurm_cluster):
    where = slurm_cluster.parent
    assert re.fullmatch(r"hpc-trainer-slurm\.\w{8}", where.name), where       # mktemp's, not a fixed name
    assert stat.S_IMODE(where.stat().st_mode) == 0o711
    for sub in ("state", "spool", "log", "munge-key"):
        assert stat.S_IMODE((where / sub).stat().st_mode) == 0o700, sub
    dbd = where / "slurmdbd.conf"
    if dbd.exists():
        assert stat.S_IMODE(dbd.stat().st_mode) == 0o600
        password = re.search(r"^StoragePass=(\S+)$", dbd.read_text(), re.M).group(1)
        assert password != "slurm" and len(password) >= 16
    daemons = [p for p in where.glob("*.pid")]
    assert {p.stem for p in daemons} >= {"slurmctld", "slurmd-node1", "slurmd-node2"}
    for pid_file in daemons:
        addresses = _listening(int(pid_file.read_text()))
        assert addresses, f"{pid_file.stem} listens on nothing?"
        assert all(a.split(":")[0] == "0100007F" for a in addresses), (pid_file.stem, addresses)


@pytest.mark.parametrize("kind", ["foreign directory", "symlink"])
def test_start_refuses_a_directory_it_did_not_make(slurm_cluster, tmp_path, kind):
    """HPC_CLUSTER_DIR naming something that is not ours: nothing is removed, nothing is started."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    target = victim if kind == "foreign directory" else tmp_path / "link"
    if kind == "symlink":
        target.symlink_to(victim)
    proc = subprocess.run(["bash", str(REPO / "hpc/cluster/start.sh")], capture_output=True, text=True,
                          env=dict(os.environ, HPC_CLUSTER_DIR=str(target)), timeout=limit("minute"))
    assert proc.returncode == 1 and "refusing to use or remove it" in proc.stderr, proc.stderr
    assert (victim / "precious").read_text() == "keep me" and sorted(os.listdir(victim)) == ["precious"]


def test_a_rank_that_dies_ends_the_submitit_job_at_once(slurm_cluster, tmp_path):
    """Seen on main: submitit's srun line had no --kill-on-bad-exit, so when one rank died before the
    rendezvous, the others waited in it for dist.timeout_s (1800 s). Now the step ends when that rank does."""
    from tests.slurm.test_submit_on_cluster import job_id, submit_py
    t0 = time.monotonic()
    proc = submit_py(slurm_cluster, "--recipe", "toy", "--tasks-per-node", "3", "--time", "00:10:00",
                     "--folder", str(tmp_path / "sub"), "--run-dir", str(tmp_path / "run"), "--follow",
                     env=slurm_env(slurm_cluster, TOY_FAIL_RANK="1"), timeout=limit("start"))
    elapsed = time.monotonic() - t0
    job = job_id(proc.stdout)
    assert proc.returncode == 1 and f"job {job}: FAILED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "ElapsedRaw"], env=slurm_env(slurm_cluster),
                         text=True, capture_output=True, timeout=limit("short")).stdout.split()
    assert ran and int(ran[0]) < 60, f"the job ran {ran} s before it failed"
    log = (tmp_path / "sub" / job / f"{job}_1_log.err").read_text()
    assert "toy: rank 1 fails before the rendezvous" in log
    record_fault("a rank dies before the rendezvous (submitit, 3 ranks)", exit_s=int(ran[0]), steps_lost=0,
                 outcome="job FAILED, that rank's error in its log", follow_returned_s=round(elapsed, 1))

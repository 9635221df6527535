"""Each row of the troubleshooting table (docs/cluster.md) has a `trainer doctor` check that catches it."""
import json
import socket

from tests.conftest import PY
from tests.slurm.test_cluster import srun
from tests.timeouts import limit


def doctor_json(proc) -> dict:
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["check"] == name)


def test_port_in_use(slurm_cluster):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = srun(slurm_cluster, "-N1", "-n2", "--kill-on-bad-exit=1", "--export", f"ALL,MASTER_PORT={port}",
                    PY, "-m", "trainer", "doctor", timeout=limit("run"))
    assert proc.returncode != 0
    assert f"MASTER_PORT {port}" in proc.stdout and "is in use" in proc.stdout and "HINT" in proc.stdout


def test_cpu_starvation_after_slurm_22_05(slurm_cluster):
    # what srun does when it does not inherit --cpus-per-task: each task bound to fewer CPUs
    proc = srun(slurm_cluster, "-N1", "-n1", "--cpus-per-task=2", "taskset", "-c", "0", PY, "-m", "trainer",
                "doctor", "--json")
    report = doctor_json(proc)
    starved = check(report, "tasks see their --cpus-per-task")
    assert proc.returncode == 1 and starved["level"] == "fail" and "SRUN_CPUS_PER_TASK" in starved["hint"]
    ok = srun(slurm_cluster, "-N1", "-n1", "--cpus-per-task=2", PY, "-m", "trainer", "doctor", "--json")
    assert check(doctor_json(ok), "tasks see their --cpus-per-task")["level"] == "ok", ok.stdout


def test_no_scontrol_in_the_container(slurm_cluster, tmp_path):
    # a container without Slurm's client tools: PATH has python but no scontrol
    (tmp_path / "python").symlink_to(PY)
    proc = srun(slurm_cluster, "-N1", "-n1", "env", f"PATH={tmp_path}", PY, "-m", "trainer", "doctor", "--json")
    found = check(doctor_json(proc), "scontrol reachable")
    assert proc.returncode == 1 and found["level"] == "fail" and "bind-mount" in found["hint"]


def test_nccl_settings(slurm_cluster):
    proc = srun(slurm_cluster, "-N1", "-n1", "--export",
                "ALL,NCCL_SOCKET_IFNAME=ib9,TORCH_NCCL_ASYNC_ERROR_HANDLING=0", PY, "-m", "trainer", "doctor", "--json")
    report = doctor_json(proc)
    assert check(report, "NCCL_SOCKET_IFNAME names an interface")["level"] == "fail"
    assert check(report, "NCCL errors abort instead of hanging")["level"] == "warn"
    good = srun(slurm_cluster, "-N1", "-n1", "--export", "ALL,NCCL_SOCKET_IFNAME=lo", PY, "-m", "trainer",
                "doctor", "--json")
    assert check(doctor_json(good), "NCCL_SOCKET_IFNAME names an interface")["level"] == "ok"


def test_tasks_vs_gpus(slurm_cluster):
    proc = srun(slurm_cluster, "-N1", "-n3", "--gpus-per-node=2", PY, "-m", "trainer", "doctor")
    assert proc.returncode != 0 and "3 tasks on this node but only 2 visible GPU(s)" in proc.stdout

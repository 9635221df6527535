"""Issue 69 point 2: a node whose network is slowed, on a local cluster whose nodes have networks of their own
(hpc/cluster/start.sh HPC_CLUSTER_NETNS=1: each slurmd in a network namespace of its own, joined by a veth to this
one, which routes between them). This is a second cluster beside the suite's own (nodes net1-net3, its own
directory, pointer and ports), started for this module. net3's veth is limited to 400 Mbit/s each way (a TBF on
both ends): its cores, its memory and the traffic among its own ranks are untouched, and with one task per node
there is no host all-reduce to see it, so only the links between hosts can: the pre-flight names net3 (exit 5)
and the restart loop relaunches on net1 and net2, which complete the run. Before issue 69 this job trained on all
three nodes at the slowed link's pace."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests import netns
from tests.conftest import REPO, record_fault
from tests.slurm.test_cluster import wait_job
from tests.slurm.test_sbatch import submit_script
from tests.timeouts import limit
from trainer.launch.restarts import read_jsonl

WHY_NOT = (netns.available() or
           (None if shutil.which("slurmctld") and shutil.which("nsenter") and shutil.which("unshare")
            else "Slurm (make slurm-install) and util-linux's nsenter/unshare are needed"))
# one xdist worker for the file: its cluster's namespaces, ports and /etc/hosts lines have fixed names
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=f"a cluster of network namespaces: {WHY_NOT}"),
              pytest.mark.one_at_a_time("netns-cluster")]
NODES = ("-N3", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10")


@pytest.fixture(scope="module")
def net_cluster(tmp_path_factory):
    where = tmp_path_factory.mktemp("netcluster") / "cluster"
    env = dict(os.environ, HPC_CLUSTER_DIR=str(where), HPC_CLUSTER_POINTER=str(where.parent / "pointer"),
               HPC_CLUSTER_NETNS="1", HPC_CLUSTER_NODE_PREFIX="net", HPC_CLUSTER_NODES="3", HPC_CLUSTER_ACCOUNTING="0",
               HPC_CLUSTER_CTLD_PORT="6917", HPC_CLUSTER_SLURMD_PORT0="6930")
    subprocess.run(["bash", str(REPO / "hpc/cluster/start.sh")], check=True, timeout=limit("runs"), env=env)
    try:
        yield where / "slurm.conf"
    finally:
        subprocess.run(["bash", str(REPO / "hpc/cluster/stop.sh")], env=env, timeout=limit("run"))


def toy(folder) -> str:
    path = folder / "toy.yaml"
    path.write_text("recipe: toy\nseed: 5\ntrain:\n  epochs: 1\n  tensorboard: false\n  preflight: 'on'\n"
                    "dist:\n  shm_allreduce: 'off'\n")
    return str(path)


@pytest.mark.timing
def test_a_node_with_a_slow_network_is_named_by_its_links_and_the_job_completes_without_it(net_cluster, tmp_path):
    net3 = netns.Node("net3", "hpc-net3", "", "hpc-net3")
    netns.slow(net3, "400mbit")
    start = time.time()
    job = submit_script(net_cluster, tmp_path, "sasrec_1node.sbatch", *NODES,
                        env=dict(CONFIG=toy(tmp_path), TRAINER_PLUGINS="tests.toy_recipe", MAX_RESTARTS="2"))
    info = wait_job(net_cluster, job, timeout=limit("job"))
    log = (tmp_path / f"sasrec-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    run = tmp_path / "runs" / job
    entries = read_jsonl(run / "restarts.jsonl")
    assert [(e["decision"], e["excluded"]) for e in entries] == [("relaunch", ["net3"])], entries
    assert "pre-flight: unfit host(s) [net3]" in entries[0]["cause"] and "links to net2" in log, entries[0]
    assert "--exclude=net3 --nodes=2 --ntasks=2" in log
    assert (run / "checkpoints" / "final.pt").exists()
    record_fault("a node's network slowed to 400 Mbit/s (local cluster of 3 nodes in network namespaces, 1 task "
                 "each, MAX_RESTARTS=2)", exit_s=round(entries[0]["time"] - start, 2), steps_lost=0,
                 outcome="the pre-flight names it by its links (exit 5); relaunched at once on the other two nodes, "
                         "completes (time: from submission to the relaunch)")


def hosts_lines(mark: str) -> list[str]:
    return [line for line in Path("/etc/hosts").read_text().splitlines() if line.endswith(f"# {mark}")]


def test_a_second_cluster_that_fails_to_start_leaves_the_other_clusters_hosts_lines(tmp_path):
    """A start that fails (here slurmctld, on a port that is no number) stops what it started and removes its own
    /etc/hosts lines and namespaces only: a run of this module once removed the suite's cluster's lines, and every
    sbatch test after it waited for a MASTER_ADDR that no longer resolved."""
    before = {mark: hosts_lines(mark) for mark in ("hpc-trainer-cluster", "hpc-trainer-cluster-net")}
    env = dict(os.environ, HPC_CLUSTER_DIR=str(tmp_path / "cluster"), HPC_CLUSTER_POINTER=str(tmp_path / "pointer"),
               HPC_CLUSTER_NETNS="1", HPC_CLUSTER_NODE_PREFIX="fail", HPC_CLUSTER_NET="10.98", HPC_CLUSTER_NODES="2",
               HPC_CLUSTER_ACCOUNTING="0", HPC_CLUSTER_CTLD_PORT="notaport")
    failed = subprocess.run(["bash", str(REPO / "hpc/cluster/start.sh")], env=env, capture_output=True, text=True,
                            timeout=limit("runs"))
    assert failed.returncode != 0 and "start.sh failed" in failed.stderr, failed.stderr[-2000:]
    assert {mark: hosts_lines(mark) for mark in before} == before and not hosts_lines("hpc-trainer-cluster-fail")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [ns for ns in names if ns.startswith("hpc-fail")], names

"""Issue 58 item 3: a node slowed for real on the local 2-node cluster. The two slurmds share this machine's cores and
Slurm here has no per-node cgroups (TaskPlugin=task/none), so the test slows a node itself: the node's processes go
on one core beside busy loops, at about a twentieth of it, the other node's on the other core. Nothing is
injected into the trainer.

- slowed from the start: the pre-flight names node2 (exit 5) and the restart loop relaunches on node1 alone, at
  once, and the job completes;
- slowed mid-run under faults.straggler_action=evict: the straggler watch names node2, the run checkpoints and exits
  5, the restart loop relaunches on node1 alone, and the final weights equal those of a run resumed on one rank from
  the same checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import assert_bitwise_equal, record_fault, run_ranks, slowed, weights
from tests.slurm.test_cluster import wait_job
from tests.slurm.test_sbatch import submit_script
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.engine.rundir import MARKER
from trainer.launch.restarts import RESTARTS, read_jsonl

pytestmark = [pytest.mark.timing, pytest.mark.cluster_alone,     # it slows every trainer process of a node
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to slow one node")]
TWO_NODES = ("-N2", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10")
ENV = dict(TRAINER_PLUGINS="tests.toy_recipe", MAX_RESTARTS="2")


def toy_yaml(folder: Path, epochs: int, extra: str = "") -> Path:
    """64 steps per epoch and rank on two ranks, each ~8 ms of matmuls (a slowed node's ~0.2 s), a logging window
    every 8: a step's own work, which the straggler watch judges, outweighs the window's logging and collective
    (tests/distributed/test_stragglers.py SLOWED); a checkpoint every 32 steps, every one kept."""
    path = folder / "toy.yaml"
    path.write_text(f"recipe: toy\nseed: 5\ndata:\n  n_train: 2048\n  features: 512\nmodel:\n  hidden: 4096\ntrain:\n"
                    f"  epochs: {epochs}\n"
                    f"  batch_size: 16\n  log_every_steps: 8\n  tensorboard: false\n{extra}"
                    "ckpt:\n  every_steps: 32\n  keep_last: 0\n")
    return path


def trainer_pids(node: str) -> list[int]:
    """The trainer processes a node's slurmd started (SLURMD_NODENAME in their environment)."""
    mark = f"SLURMD_NODENAME={node}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if b"trainer" in Path(f"/proc/{name}/cmdline").read_bytes() and \
                        mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    found.append(int(name))
    return found


def slowed_node(node: str, other: str, once: Callable[[], bool] = lambda: True,
                until: Callable[[], bool] = lambda: False):
    """tests/conftest.py slowed() for every trainer process of `node` (and each of its threads) against those of
    `other`, from when once() is true until until() is (the restart loop has decided: the slowed node's processes
    are gone): re-pinned every 50 ms, so a process is caught within its first 50 ms (a mask on the slurmd would not
    reach them: the step daemon sets its tasks' own)."""
    return slowed(lambda: trainer_pids(node), lambda: trainer_pids(other), once=once, until=until)


def test_the_preflight_names_a_slowed_node_and_the_job_completes_without_it(slurm_cluster, tmp_path, busy_core_turn):
    start = time.time()
    job = submit_script(slurm_cluster, tmp_path, "sasrec_1node.sbatch", *TWO_NODES,
                        env=dict(CONFIG=str(toy_yaml(tmp_path, 1)), **ENV))
    run = tmp_path / "runs" / job
    # from when rank 0 has claimed the run directory (the ranks' imports done: a minute at a twentieth of a core)
    with slowed_node("node2", "node1", once=(run / MARKER).exists, until=(run / RESTARTS).exists):
        info = wait_job(slurm_cluster, job, timeout=limit("job"))
    log = (tmp_path / f"sasrec-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    entries = read_jsonl(run / "restarts.jsonl")
    assert [(e["decision"], e["excluded"]) for e in entries] == [("relaunch", ["node2"])], entries
    assert "pre-flight: unfit host(s) [node2]" in entries[0]["cause"]
    assert "--exclude=node2 --nodes=1 --ntasks=1" in log
    assert (run / "checkpoints" / "final.pt").exists()
    relaunched = [r for r in read_metrics(run, "train") if "loss" in r]
    assert relaunched and relaunched[-1]["step"] == 128              # the whole epoch on one rank (batch 16)
    record_fault("a node slowed about 10x from the start (local cluster, 2 nodes x 1 task, MAX_RESTARTS=2)",
                 exit_s=round(entries[0]["time"] - start, 2), steps_lost=0,
                 outcome="the pre-flight names it (exit 5); relaunched at once on the other node, completes "
                         "(time: from submission to the relaunch)")


def started_training(run: Path, step: int, timeout: float = limit("long")) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step and "loss" in r for r in read_metrics(run, "train")):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run}: no train record of step {step} after {timeout} s")


def test_evict_leaves_a_node_slowed_mid_run_out_and_ends_as_a_resume_on_the_smaller_world(slurm_cluster, tmp_path,
                                                                                          busy_core_turn):
    cfg = toy_yaml(tmp_path, 3, "  straggler_action: evict\n")
    job = submit_script(slurm_cluster, tmp_path, "sasrec_1node.sbatch", *TWO_NODES, env=dict(CONFIG=str(cfg), **ENV))
    run = tmp_path / "runs" / job
    started_training(run, 16)
    slowed_at = time.time()
    with slowed_node("node2", "node1", until=(run / RESTARTS).exists):
        info = wait_job(slurm_cluster, job, timeout=limit("jobs"))
    log = (tmp_path / f"sasrec-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    entries = read_jsonl(run / "restarts.jsonl")
    assert [(e["decision"], e["excluded"]) for e in entries] == [("relaunch", ["node2"])], entries
    assert "straggler: unfit host(s) [node2]" in entries[0]["cause"], entries[0]
    step = entries[0]["checkpoint_step"]
    assert "--exclude=node2 --nodes=1 --ntasks=1" in log and f"resumed from {run}/checkpoints/step-{step:08d}.pt" in log
    named = [r for r in read_metrics(run, "train") if r.get("straggler_host") == "node2"]
    assert named and named[0]["straggler_factor"] >= 2.0
    # the same checkpoint resumed on one rank by hand: the relaunch's weights, bitwise
    ref = tmp_path / "ref"
    (ref / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "checkpoints" / f"step-{step:08d}.pt", ref / "checkpoints")
    run_ranks(1, "train", "--config", str(cfg), "--run-dir", str(ref), "--resume", "auto", extra_env=ENV,
              timeout=limit("long"))
    assert_bitwise_equal(weights(run), weights(ref))
    record_fault("a node slowed about 10x mid-run, faults.straggler_action=evict (local cluster, 2 nodes x 1 task)",
                 exit_s=round(entries[0]["time"] - slowed_at, 2), steps_lost=0,
                 outcome=f"named and evicted: checkpoint of step {step}, exit 5, relaunched on the other node; "
                         "bitwise equal to a resume on one rank (time: from the slowdown to the relaunch)")

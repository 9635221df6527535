"""In-allocation restarts (issue 48) on the local 2-node cluster: slurm/common.sh's MAX_RESTARTS loop relaunches a
crashed training step in the same job, from the agreed checkpoint, and stops on what a relaunch cannot mend.

The five jobs are submitted together (one fixture) and checked one per test, so the cluster runs them side by side.
"""
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, record_fault, run_ranks, slurm_env, weights
from tests.inprocess import cli
from tests.slurm.test_cluster import wait_job
from tests.slurm.test_sbatch import submit_script
from tests.timeouts import limit
from trainer.launch.restarts import read_jsonl

HANG_TIMEOUT = 5
TWO_BY_TWO = ("-N2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1", "--time=10")
ONE = ("-N1", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=10")
JOBS = {   # name: (sbatch options, toy data settings, environment)
    "kill": (TWO_BY_TWO, "crash_at_step: 10\n  crash_rank: 3\n  crash_how: kill", {}),
    "raise": (TWO_BY_TWO, "crash_at_step: 10\n  crash_rank: 1\n  crash_how: raise", {}),
    "config": (ONE, "crash_at_step: 0", {"EXTRA": "train.no_such_key=1"}),
    "nan": (ONE, "nan_at_step: 3", {}),
    "always": (TWO_BY_TWO, "crash_at_step: 6\n  crash_rank: 0\n  crash_attempts: 99", {"MAX_RESTARTS": "2"}),
    "stop": (TWO_BY_TWO, "crash_at_step: 10\n  crash_rank: 3\n  crash_how: stop",
             {"EXTRA": f"faults.hang_timeout_s={HANG_TIMEOUT}"}),
}


def toy_yaml(folder: Path, data: str) -> Path:
    path = folder / "toy.yaml"
    path.write_text(f"recipe: toy\nseed: 5\ndata:\n  step_sleep: 0.1\n  {data}\ntrain:\n  epochs: 3\n  batch_size: 16\n"
                    "  log_every_steps: 1\n  tensorboard: false\nckpt:\n  every_steps: 4\n")
    return path


def submit_supervised(conf, work: Path) -> str:
    """hpc/submit.py --max-restarts 2 of the "kill" case: submitit's batch step runs the restart loop."""
    cfg = toy_yaml(work, JOBS["kill"][1])
    argv = ["--config", str(cfg), "--nodes", "2", "--tasks-per-node", "2", "--cpus-per-task", "1", "--time", "00:10:00",
            "--folder", str(work / "submitit"), "--run-dir", str(work / "run"), "--max-restarts", "2"]
    proc = subprocess.run([PY, "hpc/submit.py", *argv], cwd=REPO, env=slurm_env(conf), text=True, capture_output=True,
                          timeout=limit("run"))
    assert proc.returncode == 0, proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Every job submitted at once, then each waited for: name -> (scontrol info, job log text, run dir)."""
    work = tmp_path_factory.mktemp("submitit")
    submitted = {"submitit": (submit_supervised(slurm_cluster, work), work)}
    for name, (opts, data, env) in JOBS.items():
        work = tmp_path_factory.mktemp(name)
        cfg = toy_yaml(work, data)
        job = submit_script(slurm_cluster, work, "sasrec_1node.sbatch", *opts,
                            env=dict(CONFIG=str(cfg), TRAINER_PLUGINS="tests.toy_recipe", **env))
        submitted[name] = (job, work)
    done = {}
    for name, (job, work) in submitted.items():
        info = wait_job(slurm_cluster, job, timeout=limit("job"))
        if name == "submitit":      # the batch step's own output: the loop's lines and the tasks' (no srun files)
            logs = sorted((work / "submitit" / job).glob("*_log.*"))
            done[name] = (info, "".join(p.read_text() for p in logs), work / "run")
            continue
        done[name] = (info, (work / f"sasrec-{job}.out").read_text(), work / "runs" / job)
    return done


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same training on 4 ranks, never interrupted."""
    work = tmp_path_factory.mktemp("reference")
    run_ranks(4, "train", "--config", str(toy_yaml(work, "crash_at_step: 0")), "--run-dir", str(work / "run"))
    return work / "run"


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_crashed_rank_is_relaunched_in_the_same_job_and_ends_bitwise_equal(jobs, uninterrupted, how):
    info, log, run = jobs[how]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]   # same job id, no requeue
    entries = read_jsonl(run / "restarts.jsonl")
    assert [e["decision"] for e in entries] == ["relaunch"], entries
    e = entries[0]
    rank = 3 if how == "kill" else 1
    assert e["ranks"] == [rank] and e["hosts"] == ["node2" if rank == 3 else "node1"] and e["decision"] == "relaunch"
    if how == "kill":
        assert e["codes"] == [None] and "killed by a signal without an exit record" in e["cause"]
    else:
        assert e["codes"] == [1] and e["cause"] == f"RuntimeError: toy: rank {rank} crashes at step 10 (injected)"
    assert e["checkpoint_step"] == 8 and e["log_tail"], e       # the second checkpoint; the job log's last lines
    assert re.search(r"resumed from \S+/step-00000008\.pt", log)
    assert "restart loop: relaunch: retryable failure (relaunch 1 of 2)" in log
    summary = re.search(r"1 relaunch\(es\) in .*\n.*\n.*resumed from step 8; (\d+) step\(s\) recomputed; "
                        r"([\d.]+) s from the failure to training again", log)
    assert summary, log[-3000:]
    assert_bitwise_equal(weights(run), weights(uninterrupted))
    record_fault(f"rank {rank} of 2 nodes x 2 tasks {'SIGKILLed' if how == 'kill' else 'raises'} after the 2nd "
                 f"checkpoint (sbatch, MAX_RESTARTS=2)", steps_lost=int(summary.group(1)),
                 exit_s=float(summary.group(2)),
                 outcome="relaunched in the same job (1 restart; time: from the crash to training again), bitwise "
                         "equal to an uninterrupted run")


def test_a_hung_rank_is_found_in_seconds_and_relaunched_ending_bitwise_equal(jobs, uninterrupted):
    """Rank 3 (node2) SIGSTOPs itself at step 10: alive and silent, as a rank stuck in NCCL or a Lustre read. The
    other ranks' hang watches name it within faults.hang_timeout_s and exit 6; srun ends it; the loop relaunches."""
    info, log, run = jobs["stop"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    entries = read_jsonl(run / "restarts.jsonl")
    assert [(e["decision"], e["ranks"], e["hosts"]) for e in entries] == [("relaunch", [3], ["node2"])], entries
    # (srun's SIGCONT and SIGTERM wake rank 3 before its SIGKILL: it may leave a record of its own, code 1)
    assert entries[0]["cause"].startswith("hang: rank 3 ") and "its hang watch has been silent" in \
        entries[0]["cause"]
    # the first watch to exit 6 ends the step: srun stops the others, maybe before they dump; rank 3, woken by srun's
    # SIGCONT, judges again from then and may dump too before its SIGKILL: a dump from another rank is what counts
    dumps = sorted(p.name for p in (run / "hangs").glob("rank-*.txt"))
    watchers = [d for d in dumps if d != "rank-3.txt"]
    assert watchers, dumps
    assert "hang: rank 3 " in (run / "hangs" / watchers[0]).read_text()
    train = [r for r in read_jsonl(run / "metrics.jsonl") if r["split"] == "train"]
    gaps = [(train[i]["time"] - train[i - 1]["time"], i) for i in range(1, len(train))]
    gap, at = max(gaps)                # from the last step before the stop to the first step of the relaunch
    # named within the timeout + 30 s of the last step before the stop (the relaunch's start after it is the
    # processes' start, a time the machine's load sets: 45 s beside the workers of make test)
    assert entries[0]["failed_at"] - train[at - 1]["time"] < HANG_TIMEOUT + 30, (entries[0], train[at - 1])
    assert_bitwise_equal(weights(run), weights(uninterrupted))
    record_fault("rank 3 of 2 nodes x 2 tasks SIGSTOPped (hung, alive) at step 10, faults.hang_timeout_s=5 (sbatch, "
                 "MAX_RESTARTS=2)", steps_lost=train[at - 1]["step"] - entries[0]["checkpoint_step"],
                 exit_s=round(gap, 1), outcome="the hang watches name rank 3 and exit 6; relaunched in the same job "
                 "(time: last step before the stop to training again), bitwise equal to an uninterrupted run")


def test_submit_max_restarts_relaunches_inside_the_submitit_job(jobs, uninterrupted):
    """hpc/submit.py --max-restarts 2: the same crash (rank 3 SIGKILLed at step 10) under submitit."""
    info, log, run = jobs["submitit"]
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    entries = read_jsonl(run / "restarts.jsonl")
    assert [(e["decision"], e["ranks"], e["hosts"]) for e in entries] == [("relaunch", [3], ["node2"])]
    assert "restart loop: relaunch: retryable failure (relaunch 1 of 2)" in log and "1 relaunch(es) in" in log
    assert "world=4" in (run / "train.log").read_text()
    assert_bitwise_equal(weights(run), weights(uninterrupted))


def test_a_rank_that_crashes_every_time_stops_after_max_restarts_leaving_its_host_out(jobs):
    """Rank 0 (node1) dies on every launch: node1 failed twice, so the second relaunch runs on node2 alone (the toy
    recipe resumes exactly on a smaller world); rank 0 dies there too and the loop stops: 2 of 2 used."""
    info, log, run = jobs["always"]
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", log[-4000:]
    entries = read_jsonl(run / "restarts.jsonl")
    assert [e["decision"] for e in entries] == ["relaunch", "relaunch", "stop"]
    assert [e["hosts"] for e in entries] == [["node1"], ["node1"], ["node2"]]
    assert entries[0]["excluded"] == [] and entries[1]["excluded"] == ["node1"]
    assert "--exclude=node1 --nodes=1 --ntasks=2" in log
    assert "restart loop: stop: 2 of MAX_RESTARTS=2 relaunches used in this allocation" in log
    assert "2 relaunch(es) in" in log and "left out: node1" in log
    assert "stopped (job" in log and "rank 0 on node2" in log and "not relaunched: 2 of MAX_RESTARTS=2" in log
    exits = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (run / "exits").glob("*.json")}
    assert exits[0]["attempt"] == 2 and exits[0]["host"] == "node2"       # the last launch ran on node2 only
    doctor = cli("doctor", "--run", str(run), check=False)            # the run's record read: in this process
    assert doctor.returncode == 0 and "2 relaunch(es) in" in doctor.stdout, doctor.stdout + doctor.stderr


@pytest.mark.parametrize("name, code, kind", [("config", 2, "usage"), ("nan", 3, "non-finite")])
def test_errors_that_would_repeat_are_not_relaunched(jobs, name, code, kind):
    info, log, run = jobs[name]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == f"{code}:0", log[-3000:]
    assert f"restart loop: stop: {kind} error (exit {code}): it would fail the same way again" in log
    assert "relaunching" not in log and "relaunch(es)" not in log
    entries = read_jsonl(run / "restarts.jsonl")
    # a configuration error stops every rank before the run opens its directory; each rank records it for the loop
    # all the same (trainer/cli/commands.py: record_for_restart_loop), so the loop need not trust srun's code alone
    assert [(e["decision"], e["ranks"]) for e in entries] == [("stop", [0])]
    if name == "config":
        assert "train.no_such_key" in entries[0]["cause"], entries[0]["cause"]

"""log.tracker=mlflow,wandb on the local cluster (issue 85 point 5): a toy job of hpc/submit.py --max-restarts 1,
preempted with SIGUSR1 at step 5 (an agreed checkpoint, the job requeued: SLURM_RESTART_COUNT 1), then its training
step SIGKILLed at its 12th step in the requeued allocation (the restart loop relaunches it from step 16's checkpoint,
two steps behind the last logged one). Each tracker is read back by its own package (MLflow's client; W&B's reader of
its offline files): one tracking run for the run directory, its curves equal to an uninterrupted run's."""
from __future__ import annotations

import json
import re
import subprocess

from tests.cluster import slurm_env
from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.slurm.test_cluster import wait_job
from tests.slurm.test_submit_on_cluster import wait_for_step
from tests.timeouts import limit
from tests.unit import test_tracking as mlflow_reader
from tests.unit import test_tracking_wandb as wandb_reader

ARGS = ("--recipe", "toy", "--epochs", "3", "log.every_steps=1", "ckpt.every_steps=8", "log.tracker=mlflow,wandb")
OFFLINE = dict(WANDB_MODE="offline", WANDB_SILENT="true")


def test_both_trackers_keep_one_run_with_an_uninterrupted_curve_across_a_requeue_and_a_restart(slurm_cluster,
                                                                                               tmp_path):
    straight = tmp_path / "straight"
    cli("train", *ARGS, "--run-dir", str(straight), env=clean_env(**OFFLINE))
    run = tmp_path / "run"
    env = slurm_env(slurm_cluster, **OFFLINE)
    argv = [*ARGS, "--max-restarts", "1", "--time", "00:10:00", "--folder", str(tmp_path / "submitit"),
            "--run-dir", str(run), "data.step_sleep=0.2", "data.crash_at_step=12", "data.crash_how=kill"]
    proc = subprocess.run([PY, "hpc/submit.py", *argv], cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=limit("run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    wait_for_step(run, 5, timeout=limit("start"))
    # to the training step, not the job (tests/slurm/test_search_on_cluster.py says why)
    subprocess.run(["scancel", "--signal=USR1", f"{job}.0"], env=env, check=True, timeout=limit("short"))
    info = wait_job(slurm_cluster, job, timeout=limit("jobs"), restarts=1)
    logs = "".join(p.read_text() for p in (tmp_path / "submitit").rglob("*_log.*"))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs[-3000:]
    relaunches = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in relaunches] == ["relaunch"], relaunches
    log = (run / "train.log").read_text()
    assert "received SIGUSR1" in log and len(re.findall(r"resumed from \S+\.pt", log)) == 2, log[-3000:]
    for key in ("train/loss", "val/mse", "test/best/mse"):
        assert mlflow_reader.curve(run, key) == mlflow_reader.curve(straight, key), key
        assert wandb_reader.curve(run, key) == wandb_reader.curve(straight, key), key
    client = mlflow_reader.client_of(run)
    runs = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == mlflow_reader.run_id(run)
    ident = wandb_reader.run_id(run)
    assert all(p.name.endswith(ident) for p in (run / "wandb").glob("offline-run-*"))

"""log.tracker=mlflow (issue 85 points 1 and 2) with the real package, read back by MLflow's own client: the resolved
config as parameters, every record of metrics.jsonl with its step, the tags (run directory, versions, exit); one
tracking run per run directory across a preemption and a crash behind the last logged step, whose curve equals an
uninterrupted run's; a tracker that fails says so once and the run goes on; a missing extra refuses the run before
it writes. (On the local cluster, across a requeue and a restart: tests/slurm/, to come.)"""
from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import clean_env, trainer
from tests.inprocess import cli
from trainer.engine.logging import read_metrics

pytest.importorskip("mlflow", reason="the mlflow extra (make setup installs it)")
# every step its own logging window: a window that a preemption cuts is logged over the steps after the resume (as in
# metrics.jsonl), which an uninterrupted run's window averages with the ones before
ARGS = ("--recipe", "toy", "--epochs", "3", "log.every_steps=1", "ckpt.every_steps=8", "log.tracker=mlflow")


def client_of(run_dir):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def run_id(run_dir) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"]


def curve(run_dir, key: str) -> list[tuple[int, float]]:
    history = client_of(run_dir).get_metric_history(run_id(run_dir), key)
    return sorted((m.step, m.value) for m in history)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A run never interrupted."""
    run = tmp_path_factory.mktemp("straight") / "run"
    cli("train", *ARGS, "--run-dir", str(run))
    return run


def test_the_tracking_run_holds_the_config_every_record_and_the_exit(straight):
    client = client_of(straight)
    run = client.get_run(run_id(straight))
    assert run.data.params["optim.lr"] == "0.001" and run.data.params["log.tracker"] == "['mlflow']"
    assert run.data.params["recipe"] == "toy" and run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["run_dir"] == str(straight.resolve()) and tags["exit_code"] == "0" and "version.torch" in tags
    assert tags["checkpoints"].endswith("checkpoints")
    train = [r for r in read_metrics(straight, "train") if "loss" in r]
    assert curve(straight, "train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in train]
    val = read_metrics(straight, "val")
    assert curve(straight, "val/mse") == [(r["step"], pytest.approx(r["mse"])) for r in val] and len(val) == 3
    assert len(curve(straight, "test/best/mse")) == 1 and len(curve(straight, "test/final/mse")) == 1


def test_a_preempted_then_crashed_run_is_one_tracking_run_with_an_uninterrupted_curve(straight, tmp_path):
    """SIGTERM at step 5 (checkpoint, exit 143: the tracking run KILLED), resumed; killed (SIGKILL, no exit record)
    at step 14, after the last logged step 13 and the checkpoint of step 8: resumed from step 8, the
    steps 9-13 trained again are not sent again."""
    run = tmp_path / "run"
    crash = ("data.crash_at_step=9", "data.crash_how=kill")        # the 9th step of a process, its first attempt
    first = trainer("train", *ARGS, *crash, "--run-dir", str(run), "data.signal_at_step=5", "data.signal_name=SIGTERM",
                    check=False)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    ident = run_id(run)
    assert client_of(run).get_run(ident).info.status == "KILLED"
    second = trainer("train", *ARGS, *crash, "--run-dir", str(run), "--resume", "auto", check=False)
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    assert json.loads((run / "tracking.json").read_text())["mlflow"]["last"]["train"] == 13
    cli("train", *ARGS, *crash, "--run-dir", str(run), "--resume", "auto", env=clean_env(TRAINER_ATTEMPT="1"))
    assert run_id(run) == ident and client_of(run).get_run(ident).info.status == "FINISHED"
    assert any(r.get("redone") for r in read_metrics(run, "train"))          # metrics.jsonl has them twice
    for key in ("train/loss", "val/mse", "test/best/mse"):
        assert curve(run, key) == curve(straight, key), key


def test_a_tracker_that_fails_is_said_once_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    ran = cli("train", *ARGS, "--run-dir", str(run), env=clean_env(MLFLOW_TRACKING_URI="nosuch://nowhere"))
    assert ran.returncode == 0 and ran.stderr.count("log.tracker=mlflow failed") == 1, ran.stderr[-2000:]
    assert "training goes on without it" in ran.stderr and len(read_metrics(run, "val")) == 3


def test_a_missing_extra_refuses_the_run_before_it_writes(tmp_path, monkeypatch):
    from trainer.native import trackers
    monkeypatch.setitem(trackers.EXTRA_MODULES, "mlflow", ("no_such_tracker_module",))
    ran = cli("train", *ARGS, "--run-dir", str(tmp_path / "run"), check=False)
    assert ran.returncode == 2 and "pip install 'hpc-trainer[mlflow]'" in ran.stderr, ran.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_tracker_name_that_is_none_is_refused_with_the_choices(tmp_path):
    ran = cli("train", "--recipe", "toy", "--run-dir", str(tmp_path / "run"), "log.tracker=tensorbord", check=False)
    assert ran.returncode == 2 and "'tensorbord' is not one of mlflow, wandb" in ran.stderr


def test_only_rank_zero_tracks():
    from types import SimpleNamespace

    from trainer.distributed.runtime import DistInfo
    from trainer.engine.components.tracking import Tracker
    ctx = SimpleNamespace(cfg=SimpleNamespace(log=SimpleNamespace(tracker=["mlflow"])), info=DistInfo(rank=1,
                                                                                                      world_size=2))
    assert Tracker.from_run(ctx) is None

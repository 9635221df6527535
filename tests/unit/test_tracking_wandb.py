"""log.tracker=wandb (issue 85 points 1 and 2) with the real package, offline as on a compute node, read back by W&B's
own reader of its offline run files (wandb.sdk.internal.datastore, the records as wandb.proto's): every record with
its step, the config, one W&B run id per run directory across a preemption and a crash behind the last logged step
(each attempt an offline run of that id, as `wandb sync` joins them), whose curve equals an uninterrupted run's, and
the sync command in the run's last lines."""
from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import clean_env, trainer
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

pytest.importorskip("wandb", reason="the wandb extra (make setup installs it)")
datastore = pytest.importorskip("wandb.sdk.internal.datastore",
                                reason="this wandb has no reader of its offline files (wandb 0.30 dropped it)")
ARGS = ("--recipe", "toy", "--epochs", "3", "log.every_steps=1", "ckpt.every_steps=8", "log.tracker=wandb")
OFFLINE = clean_env(WANDB_MODE="offline", WANDB_SILENT="true")


def run_id(run_dir) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["wandb"]["run_id"]


def records(run_dir) -> dict[str, list]:
    """Every attempt's offline run of the run directory's id, in the order they ran: their records by type."""
    from wandb.proto import wandb_internal_pb2 as pb
    found: dict[str, list] = {}
    paths = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id(run_dir)}/run-*.wandb"))
    settled(paths)
    for path in paths:
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            found.setdefault(kind, []).append(getattr(record, kind))
    return found


def settled(paths, quiet_s: float = 0.5) -> None:
    """Until the files stop growing (W&B's service may still be writing a run's last rows just after finish())."""
    import time
    deadline, sizes = time.monotonic() + limit("brief"), None
    while time.monotonic() < deadline:
        now = [p.stat().st_size for p in paths]
        if now == sizes:
            return
        sizes = now
        time.sleep(quiet_s)


def curve(run_dir, key: str) -> list[tuple[int, float]]:
    points = []
    for history in records(run_dir).get("history", []):
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in history.item}
        if key in row:
            points.append((row["_step"], row[key]))
    return points


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    ran = cli("train", *ARGS, "--run-dir", str(run), env=OFFLINE)
    return run, ran


def test_the_offline_run_holds_every_record_the_config_and_says_how_to_sync(straight):
    run, ran = straight
    train = [r for r in read_metrics(run, "train") if "loss" in r]
    assert curve(run, "train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert curve(run, "val/mse") == [(r["step"], pytest.approx(r["mse"])) for r in read_metrics(run, "val")]
    config = {item.key: json.loads(item.value_json) for c in records(run)["config"] for item in c.update}
    assert config["optim.lr"] == 0.001 and config["recipe"] == "toy"
    last = ran.stderr.strip().splitlines()[-1]
    assert f"wandb sync {run.resolve() / 'wandb'}/offline-run-*-{run_id(run)}" in last and "(finished)" in last


def test_a_preempted_then_crashed_run_keeps_one_id_and_an_uninterrupted_curve(straight, tmp_path):
    run = tmp_path / "run"
    crash = ("data.crash_at_step=9", "data.crash_how=kill")
    first = trainer("train", *ARGS, *crash, "--run-dir", str(run), "data.signal_at_step=5", "data.signal_name=SIGTERM",
                    env=OFFLINE, check=False)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    ident = run_id(run)
    second = trainer("train", *ARGS, *crash, "--run-dir", str(run), "--resume", "auto", env=OFFLINE, check=False)
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    cli("train", *ARGS, *crash, "--run-dir", str(run), "--resume", "auto", env=dict(OFFLINE, TRAINER_ATTEMPT="1"))
    # an offline run per attempt, named to the second: the killed attempt's (nothing written) and the next may share
    assert run_id(run) == ident and len(list((run / "wandb").glob(f"offline-run-*-{ident}"))) >= 2
    for key in ("train/loss", "val/mse", "test/best/mse"):
        assert curve(run, key) == curve(straight[0], key), key

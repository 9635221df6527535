"""The experiment trackers a run's records also go to (log.tracker; trainer/engine/components/tracking.py drives
them on rank 0): MLflow (the `mlflow` extra) and Weights & Biases (the `wandb` extra). Each opens its tracking run
(a new one, or the one whose id the run directory keeps), takes parameters, metric rows with their step, tags, and
ends it with a status. Their packages are imported when a run asks for them, never by the engine's import.

    backend = open_backend("mlflow", run_dir, project="sasrec", name="sasrec-123", run_id=None)
    backend.log_metrics({"val/ndcg_10": 0.31}, step=800)
"""
from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from trainer.native.extras import require

PARAM_VALUE_MAX = 500          # MLflow keeps 6,000 characters a parameter; a long list is cut, said with "..."


def metric_key(split: str, name: str) -> str:
    """`val/ndcg@10` as both trackers take a key: letters, digits and _-./ only."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", f"{split}/{name}")


class MLflowBackend:
    """One MLflow run through MlflowClient (no global active run: a process may train several runs).
    MLFLOW_TRACKING_URI when set, else an SQLite store in the run directory (RUN_DIR/mlflow.db: MLflow 3 refuses
    its plain file store), with the experiment's artifacts under RUN_DIR/mlartifacts."""

    name = "mlflow"
    durable = True             # a call returns once its rows are in the store

    def __init__(self, run_dir: Path, project: str, name: str, run_id: str | None):
        require("mlflow", "mlflow", "log.tracker=mlflow")
        require("sqlalchemy", "mlflow", "log.tracker=mlflow (its SQLite store)")
        from mlflow.tracking import MlflowClient
        # an unreachable server: a few quick tries, not MLflow's minutes of retries at every call
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=(Path(run_dir).resolve() / "mlartifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        items = [Param(k[:250], _short(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):           # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag
        self.client.log_batch(self.run_id, tags=[RunTag(k, _short(v)) for k, v in tags.items()])

    def end(self, status: str) -> None:
        """status: finished, failed or killed (a preempted run, to be continued)."""
        self.client.set_terminated(self.run_id, status.upper())

    def where(self) -> str:
        return f"MLflow run {self.run_id} at {self.uri}"


class WandbBackend:
    """One W&B run: WANDB_MODE when set, else offline (compute nodes seldom reach the internet), its files under
    RUN_DIR/wandb; the same id resumed (resume="allow"); an offline run is synced later with `wandb sync`."""

    name = "wandb"
    durable = False            # its service writes behind the call; what a killed process had sent may be lost

    def __init__(self, run_dir: Path, project: str, name: str, run_id: str | None):
        wandb = require("wandb", "wandb", "log.tracker=wandb")
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self.dir = Path(run_dir).resolve()
        if run_id:
            _next_second_if_taken(self.dir / "wandb", run_id)
        self.run = wandb.init(project=project, name=name, id=run_id or secrets.token_hex(4), resume="allow",
                              dir=str(self.dir), mode=self.mode, reinit="create_new")
        self.run_id = self.run.id

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.run.summary.update({f"run/{k}": _short(v) for k, v in tags.items()})

    def end(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)

    def where(self) -> str:
        if self.mode == "offline":
            return f"W&B run {self.run_id} (offline: wandb sync {self.dir / 'wandb'}/offline-run-*-{self.run_id})"
        return f"W&B run {self.run_id} ({self.mode})"


def _next_second_if_taken(folder: Path, run_id: str) -> None:
    """W&B names an attempt's offline run by the second it starts (offline-run-YYYYMMDD_HHMMSS-ID): an attempt that
    starts in the second its killed predecessor did would write into that run's file, where its rows are lost."""
    while list(folder.glob(f"offline-run-{time.strftime('%Y%m%d_%H%M%S')}-{run_id}")):
        time.sleep(1.05 - time.time() % 1)


BACKENDS = {"mlflow": MLflowBackend, "wandb": WandbBackend}
EXTRA_MODULES = {"mlflow": ("mlflow", "sqlalchemy"), "wandb": ("wandb",)}


def check_installed(kinds: list[str]) -> None:
    """Before a run writes anything: each tracker's package, or MissingExtraError naming its extra (exit 2)."""
    import importlib.util
    for kind in kinds:
        for module in EXTRA_MODULES[kind]:
            if importlib.util.find_spec(module) is None:
                require(module, kind, f"log.tracker={kind}")


def open_backend(kind: str, run_dir: Path, project: str, name: str, run_id: str | None):
    return BACKENDS[kind](run_dir, project, name, run_id)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= PARAM_VALUE_MAX else text[:PARAM_VALUE_MAX - 3] + "..."

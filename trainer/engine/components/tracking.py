"""log.tracker: rank 0's records (metrics.jsonl's) also in MLflow and/or Weights & Biases (trainer/native/trackers.py),
one tracking run per run directory. RUN_DIR/tracking.json keeps each tracker's run id and the last step it holds of
each series (MLflow's at once; W&B's once its run has finished: its service loses what it had not written when the
process is killed, and the next attempt sends metrics.jsonl's records after that step first), so a requeue, an
in-allocation restart or a `--resume auto` continues the same tracking run, and the steps a resume trains again
(from a checkpoint behind the last logged step) are not sent twice: the tracker's curve is an uninterrupted run's.
A tracker that fails (a server out of reach, a full disk, a bad URI) is said once and dropped; training goes on.
Other ranks run none of it.

    python -m trainer train --recipe sasrec log.tracker=mlflow             # RUN_DIR/mlflow.db, or MLFLOW_TRACKING_URI
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from trainer.engine.callbacks import Component, RunContext
from trainer.native.trackers import metric_key

log = logging.getLogger(__name__)

STATE = "tracking.json"
NOT_METRICS = ("split", "epoch", "step", "time", "redone", "checkpoint", "count")


def flat_config(section: Any, prefix: str = "") -> dict[str, Any]:
    """The resolved config as dotted keys (its dataclasses' fields; plugin sections included)."""
    import dataclasses
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_config(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def series_of(record: dict[str, Any]) -> str:
    """The record's series: its split, and for a test of a named checkpoint that too (test/best, test/final)."""
    checkpoint = record.get("checkpoint")
    return f"{record['split']}/{checkpoint}" if checkpoint else str(record["split"])


def numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k not in NOT_METRICS and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class Tracker(Component):
    """The trackers log.tracker names, on rank 0."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> Tracker | None:
        if not ctx.cfg.log.tracker or not ctx.info.is_main:
            return None
        return cls(list(ctx.cfg.log.tracker), ctx.run_dir, ctx.cfg, ctx.info)

    def __init__(self, kinds: list[str], run_dir: Path, cfg, info):
        from trainer.native.trackers import open_backend
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / STATE
        self.state: dict[str, dict[str, Any]] = self._read()
        self.backends: dict[str, Any] = {}
        self.sent: dict[str, dict[str, int]] = {}     # per tracker, the last step sent of each series (this attempt)
        self.ended = False
        project, name = cfg.log.tracker_project or cfg.recipe, self.run_dir.name
        for kind in dict.fromkeys(kinds):
            kept = self.state.get(kind, {})
            fresh = not kept.get("run_id")
            backend = self._call(kind, lambda: open_backend(kind, self.run_dir, project, name, kept.get("run_id")))
            if backend is None:
                continue
            self.backends[kind] = backend
            self.state[kind] = dict(run_id=backend.run_id, last=kept.get("last", {}))
            self.sent[kind] = dict(self.state[kind]["last"])
            if fresh:
                self._each_once(kind, lambda b: b.log_params(flat_config(cfg)))
            self._each_once(kind, lambda b: b.set_tags(self._tags(info)))
            log.info("log.tracker: %s", backend.where())
        self._catch_up()
        self._write()

    def _catch_up(self) -> None:
        """What metrics.jsonl holds from earlier attempts that a tracker does not (an attempt killed before its
        tracker wrote them out: W&B's service loses what it had not written, and the resume starts behind them),
        sent first; a record a resume redid (redone) stays the first attempt's, as in metrics.jsonl."""
        from trainer.engine.logging import read_metrics
        for record in read_metrics(self.run_dir):
            if not record.get("redone"):
                self._send(record)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError:
            log.warning("%s: not JSON: the trackers start new runs", self.path)
            return {}

    def _write(self) -> None:
        tmp = self.path.with_name(STATE + ".tmp")
        try:
            tmp.write_text(json.dumps(self.state, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as err:          # (the metrics writer says a full disk; the trackers go on)
            log.debug("%s: %s", self.path, err)

    def _tags(self, info) -> dict[str, Any]:
        from trainer.engine.ckpt_io import versions
        tags = dict(run_dir=str(self.run_dir.resolve()), checkpoints=str((self.run_dir / "checkpoints").resolve()),
                    world_size=info.world_size, job=info.job_id or "", restart=info.restart_count,
                    **{f"version.{k}": v for k, v in versions().items()})
        data = self.run_dir / "data.json"
        if data.exists():
            try:
                tags["data_fingerprint"] = json.loads(data.read_text()).get("fingerprint", "")
            except ValueError:
                pass
        return tags

    def _call(self, kind: str, fn):
        """fn() for the tracker `kind`, or None when it fails: said once, the tracker dropped."""
        try:
            return fn()
        except Exception as err:   # a tracker's failure never stops the training (ImportError: its extra)
            log.warning("log.tracker=%s failed (%s: %s); training goes on without it", kind, type(err).__name__,
                        str(err).splitlines()[0] if str(err) else "")
            self.backends.pop(kind, None)
            return None

    def _each_once(self, kind: str, fn) -> None:
        backend = self.backends.get(kind)
        if backend is not None:
            self._call(kind, lambda: fn(backend) or True)

    def logged(self, record: dict[str, Any]) -> None:
        if self._send(record):
            self._write()

    def _send(self, record: dict[str, Any]) -> bool:
        """The record to each tracker that has not had its step of the series; True when a durable tracker's last
        step moved (tracking.json is due)."""
        values, series, step = numbers(record), series_of(record), int(record.get("step", 0))
        moved = False
        if not values or record.get("redone"):
            return False                    # (a redone step: sent before the resume went back behind it)
        for kind in list(self.backends):
            sent = self.sent[kind]
            if step <= sent.get(series, -1):
                continue
            metrics = {metric_key(series, k): v for k, v in values.items()}
            if self._call(kind, lambda: self.backends[kind].log_metrics(metrics, step) or True):
                sent[series] = step
                if self.backends[kind].durable:         # written when the call returns (MLflow's store)
                    self.state[kind]["last"] = dict(sent)
                    moved = True
        return moved

    def exited(self, code: int, cause: str) -> None:
        status = "finished" if code == 0 else "killed" if "preempt" in cause or code >= 128 else "failed"
        for kind in list(self.backends):
            self._each_once(kind, lambda b: b.set_tags(dict(exit_code=code, exit_cause=cause[:500])))
            self._each_once(kind, lambda b: b.end(status))
            if kind in self.backends:           # ended: what it was sent is written out (W&B's finish)
                self.state[kind]["last"] = dict(self.sent[kind])
                log.info("log.tracker: %s (%s)", self.backends[kind].where(), status)
        self._write()
        self.ended = True

    def close(self) -> None:
        if not self.ended:
            for kind in list(self.backends):
                self._each_once(kind, lambda b: b.end("killed"))
        self.backends.clear()

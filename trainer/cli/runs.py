"""`python -m trainer runs DIR`: a folder of run directories (a grid's from hpc/submit.py --sweep, any folder of
runs) read as one table: the settings that differ between them, each run's state (completed, running, failed with
its exit cause, pruned, preempted, stopped), its best epoch, the selection metric and the test metrics, best first.

    python -m trainer runs runs/sweep-lr                       # the table in the terminal
    python -m trainer runs runs/sweep-lr --format md --plot runs/sweep-lr/runs.png
    python -m trainer runs runs/sweep-lr --rerun-failed        # the array indices of the failed points

Reads only files (config.yaml, metrics.jsonl, exits/rank-0.json, the run directory's lock): no process group, no
checkpoint loaded; the recipe's selection metric comes from its registered class when train.select_metric is "".
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.engine.rundir import LOCK_NAME, MARKER

FORMATS = ("table", "csv", "md")
SKIPPED_KEYS = ("run_dir",)            # differs by construction: the table's first column says it
INDEX = re.compile(r"^(\d{3,})(?:-|$)")   # a sweep point's folder: 000-optim.lr-0.01 (its array index)


@dataclass
class RunRow:
    """One run directory as the table shows it."""

    path: Path
    settings: dict[str, Any]
    state: str                            # completed | running | failed | pruned | preempted | stopped
    cause: str = ""                       # a failed run's exit cause (its exit code in front)
    metric: str = ""                      # the selection metric and its mode, e.g. ndcg@10:max
    best: float | None = None
    best_epoch: int | None = None
    test: dict[str, float] = field(default_factory=dict)
    curve: list[tuple[int, float]] = field(default_factory=list)    # (step, the selection metric) per validation

    @property
    def index(self) -> int | None:
        """The sweep point's array index, from its folder's name (None: not a sweep point's folder)."""
        match = INDEX.match(self.path.name)
        return int(match.group(1)) if match else None


def find_run_dirs(root: Path) -> list[Path]:
    """Every run directory under root (root itself included): a folder a run has claimed (its marker file), or
    one with a metrics.jsonl (a run of before the marker)."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory (runs DIR: a folder of run directories)")
    found = {p.parent for name in (MARKER, "metrics.jsonl") for p in root.rglob(name)}
    return sorted(p for p in found if not any(q != p and q in p.parents for q in found))


def flatten(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}; lists and mappings at the leaves as their JSON text."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, dict)):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def read_settings(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML ({err})") from None
    return {k: v for k, v in flatten(loaded).items() if k not in SKIPPED_KEYS}


def is_live(run_dir: Path) -> bool:
    """Whether a live process holds the run directory's lock (rank 0 while it trains)."""
    path = run_dir / LOCK_NAME
    if not path.exists():
        return False
    with open(path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            return err.errno in (errno.EAGAIN, errno.EACCES)
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def read_state(run_dir: Path) -> tuple[str, str]:
    """(state, cause) from rank 0's exit record and the lock: a run whose lock is held is running; no exit record
    and no holder: stopped (killed without a word, or not started)."""
    if is_live(run_dir):
        return "running", ""
    record_path = run_dir / "exits" / "rank-0.json"
    if not record_path.exists():
        return "stopped", "no exit record (killed, or still queued)"
    with contextlib.suppress(ValueError):
        record = json.loads(record_path.read_text())
        kind, code = record.get("kind", ""), record.get("code")
        if kind == "pruned":
            return "pruned", str(record.get("cause", ""))
        if kind == "preempted":           # an agreed checkpoint: a requeue (or --resume auto) goes on from it
            return "preempted", str(record.get("cause", ""))
        if code == 0:
            return "completed", ""
        first = str(record.get("cause", "")).strip().splitlines()[:1]     # (its HINT lines: doctor --run)
        return "failed", f"exit {code}: {kind}: {first[0] if first else ''}".strip(": ")
    return "failed", f"{record_path}: not JSON"


def selection_of(settings: dict[str, Any]) -> tuple[str, str]:
    """(metric, mode) the run selects its best checkpoint by: train.select_metric, else the recipe's own."""
    from trainer.config.registry import get_spec
    from trainer.engine.selection import selected_metric
    setting = str(settings.get("train.select_metric") or "")
    try:
        own = tuple(get_spec(str(settings.get("recipe", ""))).recipe_class().primary_metric)
    except (KeyError, ValueError):     # a recipe this process does not know (a plugin's): NAME alone is maximised
        if not setting.strip():
            raise
        own = ("", "max")
    return selected_metric(setting, own)      # the recipe's metric named without a mode keeps the recipe's mode


def read_run(run_dir: Path, metric: tuple[str, str] | None = None) -> RunRow:
    """One run directory's row; metric: (name, mode) instead of the run's own selection metric."""
    from trainer.engine.logging import read_metrics
    from trainer.engine.selection import better
    settings = read_settings(run_dir)
    state, cause = read_state(run_dir)
    row = RunRow(run_dir, settings, state, cause)
    records = read_metrics(run_dir)
    if not records:
        return row
    name, mode = metric or selection_of(settings)
    row.metric = f"{name}:{mode}"
    by_step: dict[int, dict] = {}
    for record in records:                 # a step redone after a resume: its last record counts
        if record.get("split") == "val" and name in record:
            by_step[int(record.get("step", 0))] = record
    row.curve = [(step, float(r[name])) for step, r in sorted(by_step.items())]
    for r in by_step.values():
        if row.best is None or better(float(r[name]), row.best, mode):
            row.best, row.best_epoch = float(r[name]), r.get("epoch")
    tests = [r for r in records if r.get("split") == "test"]
    chosen = [r for r in tests if r.get("checkpoint") == "best"] or tests
    if chosen:
        row.test = {k: v for k, v in chosen[-1].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and k not in ("epoch", "step", "time", "count", "eval_time_s")}
    return row


def varied(rows: list[RunRow]) -> list[str]:
    """The settings whose values differ between the runs (a key some runs lack counts as differing)."""
    keys = sorted({k for r in rows for k in r.settings})
    return [k for k in keys if len({json.dumps(r.settings.get(k), sort_keys=True, default=str) for r in rows}) > 1]


def ordered(rows: list[RunRow]) -> list[RunRow]:
    """Best first by the selection metric (in its mode); runs without a value after them, by path."""
    def key(row: RunRow):
        if row.best is None:
            return (1, 0.0, str(row.path))
        sign = -1 if row.metric.endswith(":max") else 1
        return (0, sign * row.best, str(row.path))
    return sorted(rows, key=key)

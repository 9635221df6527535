"""A search's study: Optuna in journal storage on the shared file system (RUN_DIR/journal.log, locked with a file
that O_EXCL creates, which NFS honours; no database server), and the task side of a search: each array task claims
one trial once (a requeue, a restart or a resume of the task finds its claim and continues the same trial in the
same run directory) and tells the study how it ended.

    study = open_study(search_dir)                        # the study hpc/submit.py --search created
    claim = claim_trial(search_dir, slot=3)               # rank 0 (or the batch step) asks; the other ranks wait
    claim.overrides, claim.run_dir                         # ['optim.lr=0.0031', 'search.trial=3', ...], DIR/003-trial3
    # hpc/task.py SearchTask then tells the study how the trial's run ended (finish_trial)

Layout of a search's folder: search.json (the space, the metric, the slots handed out), journal.log (the study),
slots/NNN.json (array task NNN's trial), NNN-trialT/ (the trial's run directory).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.native.extras import require
from trainer.search.space import Param, Space

log = logging.getLogger(__name__)
STUDY_NAME = "search"
JOURNAL, MANIFEST, SLOTS = "journal.log", "search.json", "slots"


def optuna():
    return require("optuna", extra="search", purpose="hpc/submit.py --search (an Optuna study)")


def storage(search_dir: Path):
    """The study's journal storage in the search folder."""
    storages = optuna().storages
    path = str(Path(search_dir) / JOURNAL)
    lock = storages.journal.JournalFileOpenLock(path)
    return storages.JournalStorage(storages.journal.JournalFileBackend(path, lock_obj=lock))


def direction_of(mode: str) -> str:
    return "maximize" if mode == "max" else "minimize"


def create_study(search_dir: Path, space: Space, metric: str, mode: str, trials: int) -> list[int]:
    """The study (or the existing one of this folder: a later submission adds trials to it) and the slots, the
    array tasks' numbers, handed out to this submission: [first, first + trials)."""
    search_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = search_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest and (manifest.get("metric"), manifest.get("mode")) != (metric, mode):
        raise ValueError(f"{search_dir}: the study there optimises {manifest.get('metric')}:{manifest.get('mode')}, "
                         f"not {metric}:{mode} (another --run-dir starts a new search)")
    study = optuna().create_study(storage=storage(search_dir), study_name=STUDY_NAME, load_if_exists=True,
                                  direction=direction_of(mode))
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("metric", f"{metric}:{mode}")
    first = int(manifest.get("slots", 0))
    manifest.update(space=space.to_dict(), metric=metric, mode=mode, slots=first + trials)
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    return list(range(first, first + trials))


def read_manifest(search_dir: Path) -> dict[str, Any]:
    path = Path(search_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path}: not a search folder (hpc/submit.py --search creates it)")
    return json.loads(path.read_text())


def open_study(search_dir: Path, space: Space | None = None, slot: int = 0):
    """The folder's study with its sampler (TPE or random, seeded by the space's seed and the asking task's slot:
    every task opens a sampler of its own, and one seed would draw the same first point in each) and pruner (median
    or none) from the space."""
    space = space or Space.from_dict(read_manifest(search_dir)["space"])
    o = optuna()
    seed = space.seed * 100_003 + slot
    sampler = (o.samplers.RandomSampler(seed=seed) if space.sampler == "random"
               else o.samplers.TPESampler(seed=seed, constant_liar=True))    # liar: running trials spread the next
    pruner = (o.pruners.NopPruner() if space.pruner == "none" else
              o.pruners.MedianPruner(n_startup_trials=space.startup_trials, n_warmup_steps=space.prune_after_epochs))
    return o.load_study(study_name=STUDY_NAME, storage=storage(search_dir), sampler=sampler, pruner=pruner)


def suggest(trial, key: str, param: Param) -> Any:
    if param.kind == "choices":
        return trial.suggest_categorical(key, list(param.choices))
    if param.kind == "int":
        return trial.suggest_int(key, param.low, param.high, log=param.log, step=param.step or 1)
    return trial.suggest_float(key, param.low, param.high, log=param.log, step=param.step)


@dataclass(frozen=True)
class Claim:
    """Array task `slot`'s trial: its number, the values drawn and its run directory."""

    slot: int
    trial: int
    params: dict[str, Any]
    run_dir: str

    @property
    def overrides(self) -> list[str]:
        """The trial's key=value overrides, its study and number (search.*: its component reports there)."""
        values = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in self.params.items()]
        return [*values, f"search.study={Path(self.run_dir).parent}", f"search.trial={self.trial}"]


def slot_path(search_dir: Path, slot: int) -> Path:
    return Path(search_dir) / SLOTS / f"{slot:03d}.json"


def claim_trial(search_dir: Path, slot: int, asks: bool = True, wait_s: float = 600.0) -> Claim:
    """Slot's trial: the one claimed before (a requeued, restarted or resumed task continues it), else, where this
    process asks (rank 0, or a batch step), a new trial from the study, claimed before training starts; a process
    that does not ask waits for the claim (up to wait_s)."""
    path = slot_path(search_dir, slot)
    deadline = time.monotonic() + wait_s
    while not path.exists() and not asks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: rank 0 did not claim a trial within {wait_s:.0f} s")
        time.sleep(0.2)
    if path.exists():
        return Claim(**json.loads(path.read_text()))
    space = Space.from_dict(read_manifest(search_dir)["space"])
    study = open_study(search_dir, space, slot)
    trial = study.ask()
    params = {key: suggest(trial, key, param) for key, param in space.params.items()}
    trial.set_user_attr("slot", slot)
    claim = Claim(slot, trial.number, params, str(Path(search_dir).resolve() / f"{slot:03d}-trial{trial.number}"))
    trial.set_user_attr("run_dir", claim.run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(claim.__dict__) + "\n")
    os.replace(tmp, path)
    log.info("search: task %d trains trial %d: %s", slot, trial.number,
             " ".join(f"{k}={v}" for k, v in params.items()))
    return claim


def is_finished(search_dir: Path, claim: Claim) -> bool:
    """The claim's trial was told already (a task run again after its trial ended: nothing to train)."""
    state = open_study(search_dir).trials[claim.trial].state
    return state.is_finished()

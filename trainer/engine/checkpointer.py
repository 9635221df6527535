"""A run's checkpoints: snapshot (model, optimizer, schedule, scaler, loop state, every rank's RNG), save
(rank 0, atomic, pruned), resume (--resume auto|PATH) and initial weights (--init-from).

    ckpts = Checkpointer(run, run_dir)
    state, metrics = ckpts.resume() or (TrainState(), {})
    ckpts.save("periodic", state, metrics)
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config.settings import to_dict
from trainer.data import cache
from trainer.data.fingerprint import data_changes, data_fingerprint
from trainer.distributed import runtime
from trainer.engine import ckpt_io, resume, step_graph
from trainer.engine.build import Run
from trainer.engine.capabilities import DataProvenance, Prediction, of
from trainer.engine.state import TrainState, where
from trainer.launch.exitcodes import DiskError

log = logging.getLogger(__name__)


def data_of(run: Run) -> dict:
    """The fingerprint of the run's data (trainer/data/fingerprint.py): its files' sizes and hashes, remembered
    in the data cache so that a warm start reads no file again, and the recipe's counts."""
    data_cfg = run.cfg.data
    root = cache.root_of(getattr(data_cfg, "cache", ""))
    data = of(run.recipe, DataProvenance)
    return data_fingerprint(data.data_files(), data.data_counts(), getattr(data_cfg, "path", ""),
                            root / "fingerprints" if root is not None else None)


class Checkpointer:
    """Snapshot, save, prune and resume the checkpoints of one run."""

    def __init__(self, run: Run, run_dir: Path, planned: resume.Planned | None = None):
        self.run, self.info, self.cfg = run, run.info, run.cfg
        self.planned = planned           # the checkpoint check_resume_config chose (and rank 0 already read)
        self.files = ckpt_io.CheckpointFolder(run_dir, run.cfg.ckpt.keep_last)
        self.notes: list[str] = []       # what a resume under another layout or lr changed (metrics.jsonl)
        self.component_states: dict[str, Any] | None = None   # a resumed checkpoint's components' states (by key)
        self.id_maps = {k: torch.as_tensor(np.asarray(v)) for k, v in of(run.recipe, Prediction).id_maps().items()}
        self.data = data_of(run)         # the data's fingerprint: in every checkpoint, checked on resume

    def write_id_maps(self) -> None:
        """data.remap_ids: the maps beside the checkpoints too (RUN_DIR/ids.npz), once the run was not refused."""
        if self.id_maps and self.info.is_main:
            np.savez(self.files.dir.parent / "ids.npz", **{k: v.numpy() for k, v in self.id_maps.items()})

    @property
    def dir(self) -> Path:
        return self.files.dir

    def snapshot(self, kind: str, state: TrainState, metrics: dict, components: dict | None = None) -> dict[str, Any]:
        run = self.run
        rngs = runtime.all_gather_object(ckpt_io.capture_rng(), self.info)
        return dict(format=ckpt_io.FORMAT_VERSION, recipe=self.cfg.recipe, kind=kind, model=run.model.state_dict(),
                    optimizer=step_graph.plain_state(run.optimizer.state_dict()), scheduler=run.scheduler.state_dict(),
                    scaler=run.scaler.state_dict(), state=asdict(state), world_size=self.info.world_size,
                    global_step=state.global_step, rng=rngs, config=to_dict(self.cfg),
                    metrics=metrics, versions=ckpt_io.versions(), data=self.data,
                    **({"id_maps": self.id_maps} if self.id_maps else {}),
                    **({"components": components} if components else {}))

    def save(self, kind: str, state: TrainState, metrics: dict, components: dict | None = None) -> None:
        """Every rank contributes its RNG state; rank 0 writes atomically. components: the components' states by
        their state_key (callbacks.Component.state_dict)."""
        snap = self.snapshot(kind, state, metrics, components)
        failed = None
        if self.info.is_main:
            try:
                path = self.files.save(snap, kind)
                log.info("saved %s checkpoint %s (%s, step %d)", kind, path, where(state), state.global_step)
            except DiskError as err:
                failed = str(err)
        # every rank learns of a failed write (and stops with it) here, where it waited at a barrier before
        failed = runtime.broadcast_object(failed, self.info)
        if failed:
            raise DiskError(failed)

    def resume(self) -> tuple[TrainState, dict] | None:
        """Restore from --resume PATH or the newest valid checkpoint of the run directory; a run that starts
        fresh takes its initial weights from --init-from (weights only) when given. None: a fresh start."""
        restored = self._restore()
        if restored is None and self.cfg.ckpt.init_from:
            self._init_from(self.cfg.ckpt.init_from)
        return restored

    def _init_from(self, path: str) -> None:
        """Weights of another run's checkpoint; optimizer, schedule, step and RNG start fresh."""
        ckpt = ckpt_io.load(path)
        ckpt_io.check_compatible(ckpt, self.cfg.recipe, self.run.model, path)
        self.run.model.load_state_dict(ckpt["model"])
        log.info("initial weights from %s (step %d of that run); optimizer, schedule and step start fresh",
                 path, ckpt["global_step"])

    def _path_to_resume(self) -> str | None:
        spec = self.cfg.ckpt.resume
        if spec != "auto":
            return spec or None
        if self.planned is not None:
            path = self.planned.path
        else:
            found = self.files.newest_valid() if self.info.is_main else None
            path = runtime.broadcast_object(str(found[0]) if found else None, self.info)
        if path is None:
            log.info("--resume auto: no checkpoint in %s, starting fresh", self.files.dir)
        return path

    def _restore(self) -> tuple[TrainState, dict] | None:
        path = self._path_to_resume()
        if path is None:
            return None
        run = self.run
        ckpt = (self.planned.take(path) if self.planned is not None else None) or ckpt_io.load(path)
        data_note = self._data_changed(ckpt, path)      # first: other data is the likelier cause of other shapes
        ckpt_io.check_compatible(ckpt, self.cfg.recipe, run.model, path)
        fresh = [group["initial_lr"] for group in run.optimizer.param_groups]     # this run's (scaled) lr
        run.model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        run.scheduler.load_state_dict(ckpt["scheduler"])
        run.scaler.load_state_dict(ckpt["scaler"])
        ckpt_io.check_id_maps(ckpt, self.id_maps, path)
        state = TrainState(**ckpt["state"])
        self.component_states = dict(ckpt.get("components", {}))
        if ckpt["world_size"] == self.info.world_size:
            ckpt_io.restore_rng(ckpt["rng"][self.info.rank])
        self.notes = resume.continue_at(state, ckpt, run) + data_note + ckpt_io.version_changes(ckpt.get("versions"))
        old_lr = list(run.scheduler.base_lrs)
        if resume.apply_lr(run.scheduler, fresh):
            self.notes.append(f"peak lr {old_lr[0]:g} -> {fresh[0]:g} from step {state.global_step + 1}")
        for note in self.notes:
            log.warning("%s", note)
        log.info("resumed from %s: %s, step %d", path, where(state), state.global_step)
        if self.info.is_main:
            self.files.set_aside_newer(state.global_step, path, self.cfg.recipe)
        return state, ckpt.get("metrics", {})

    def _data_changed(self, ckpt: dict, path: str) -> list[str]:
        """Refuse a resume on data other than the checkpoint's (CheckpointError, exit 2) unless
        ckpt.allow_data_change (--allow-data-change): then a note "data changed on resume: ..." (metrics.jsonl)."""
        changes = data_changes(ckpt.get("data"), self.data)
        if not changes:
            return []
        what = "; ".join(changes)
        if not self.cfg.ckpt.allow_data_change:
            raise ckpt_io.CheckpointError(
                f"--resume from {path}: the data differs from the data it trained on: {what}.\nHINT: resume on "
                f"that data, or add --allow-data-change to go on with this data (logged as changed on resume)")
        return [f"data changed on resume: {what}"]

    def last_good(self) -> str:
        """Rank 0: the newest checkpoint on disk, for error messages."""
        newest = self.files.candidates()[:1]
        return f"the last good checkpoint is {newest[0]}" if newest else "no checkpoint was written yet"

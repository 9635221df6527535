"""Atomic, validated checkpoints: write to a temp file, fsync, rename; load with weights_only=True."""
from __future__ import annotations

import logging
import os
import platform
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)
PERIODIC = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run; the message says why."""


def versions() -> dict[str, str]:
    """Library versions stored with every checkpoint."""
    return dict(python=platform.python_version(), torch=str(torch.__version__), numpy=str(np.__version__),
                cuda=str(torch.version.cuda), trainer=_trainer_version())


def _trainer_version() -> str:
    try:
        from importlib.metadata import version
        return version("hpc-trainer")
    except Exception:  # not installed as a distribution (e.g. PYTHONPATH use)
        return "dev"


def capture_rng() -> dict[str, Any]:
    """RNG states of this process as tensors and plain types (safe for weights_only loading)."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = dict(python=[py[0], list(py[1]), py[2]],
                 numpy=[kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
                 torch=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of capture_rng()."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str | Path, map_location: str = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely, or raise CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else "")
        raise CheckpointError(f"checkpoint {path} is truncated, corrupt or unsafe "
                              f"({type(err).__name__}: {why})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "recipe" not in ckpt:
        raise CheckpointError(f"{path} is not a trainer checkpoint (no 'model'/'recipe' entries)")
    return ckpt


def check_compatible(ckpt: dict[str, Any], recipe: str, model: torch.nn.Module, path: Any) -> None:
    """Refuse a checkpoint of another recipe or with differently shaped weights."""
    if ckpt["recipe"] != recipe:
        raise CheckpointError(f"{path} was written by recipe {ckpt['recipe']!r}; this run is {recipe!r}.\n"
                              f"HINT: point --resume/--run-dir at a run of the same recipe.")
    own = model.state_dict()
    missing = sorted(set(own) - set(ckpt["model"]))
    extra = sorted(set(ckpt["model"]) - set(own))
    shapes = [f"{k}: checkpoint {tuple(ckpt['model'][k].shape)} vs model {tuple(v.shape)}"
              for k, v in own.items() if k in ckpt["model"] and ckpt["model"][k].shape != v.shape]
    if missing or extra or shapes:
        detail = "; ".join(filter(None, [f"missing {missing[:5]}" if missing else "",
                                         f"unexpected {extra[:5]}" if extra else "", "; ".join(shapes[:5])]))
        raise CheckpointError(f"{path} does not fit this model ({detail}).\n"
                              f"HINT: the model config differs from the run that wrote it "
                              f"(see the checkpoint's config).")


class CheckpointManager:
    """Names, writes and finds the checkpoints of one run directory (rank 0 writes)."""

    def __init__(self, run_dir: str | Path, keep_last: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def periodic_path(self, global_step: int) -> Path:
        """step-00000123.pt."""
        return self.dir / f"step-{global_step:08d}.pt"

    def save(self, state: dict[str, Any], kind: str) -> Path:
        """kind: 'periodic', 'best' or 'final'. Periodic files beyond keep_last are removed."""
        path = self.periodic_path(state["global_step"]) if kind == "periodic" else self.dir / f"{kind}.pt"
        atomic_save(state, path)
        if kind == "periodic":
            self._prune()
        return path

    def _prune(self) -> None:
        periodic = sorted(p for p in self.dir.glob("step-*.pt") if PERIODIC.match(p.name))
        for old in periodic[: max(len(periodic) - max(self.keep_last, 1), 0)]:
            old.unlink(missing_ok=True)

    def candidates(self) -> list[Path]:
        """Resumable checkpoints, newest first (final, then periodic by step)."""
        periodic = sorted((p for p in self.dir.glob("step-*.pt") if PERIODIC.match(p.name)),
                          key=lambda p: int(PERIODIC.match(p.name).group(1)), reverse=True)
        final = [self.dir / "final.pt"] if (self.dir / "final.pt").exists() else []
        return final + periodic

    def newest_valid(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads; truncated or corrupt ones are skipped with a warning."""
        best: tuple[int, Path, dict] | None = None
        for path in self.candidates():
            try:
                ckpt = load(path)
            except CheckpointError as err:
                log.warning("skipping %s", err)
                continue
            if best is None or ckpt["global_step"] > best[0]:
                best = (ckpt["global_step"], path, ckpt)
            if path.name != "final.pt":
                break
        return (best[1], best[2]) if best else None

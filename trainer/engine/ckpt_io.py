"""Atomic, validated checkpoints: write to a temp file, fsync, rename; load with weights_only=True."""
from __future__ import annotations

import logging
import os
import platform
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.launch.exitcodes import disk_error

log = logging.getLogger(__name__)
PERIODIC = re.compile(r"^step-(\d+)\.pt$")
TEMPORARY = re.compile(r"^\..+\.pt\.tmp\.\d+$")   # atomic_save's, left by a killed save


# The checkpoint file format: every checkpoint carries `format`; one without it (written before the field
# existed) is format 1. A format's keys are all required: a file without one of them is damaged or foreign.
# Format 2: `state` holds the epoch's position in samples and the layout that wrote it (sample_in_epoch,
# batches_in_epoch, layout), which a format-1 trainer cannot take; a format-1 file resumes by its batch position.
FORMAT_VERSION = 2
_KEYS_1 = ("recipe", "kind", "model", "optimizer", "scheduler", "scaler", "state", "world_size", "global_step", "rng",
           "config")
FORMAT_KEYS = {1: _KEYS_1, 2: _KEYS_1}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used by this run; the message says why."""


class NewerCheckpointError(CheckpointError):
    """A checkpoint in a format newer than this trainer reads: refused, but kept in place (a newer trainer
    reads it), never set aside as corrupt."""


def versions() -> dict[str, str]:
    """Library versions stored with every checkpoint."""
    return dict(python=platform.python_version(), torch=str(torch.__version__), numpy=str(np.__version__),
                cuda=str(torch.version.cuda), trainer=_trainer_version())


def version_changes(saved: dict | None) -> list[str]:
    """What differs between the versions a checkpoint was written with and this process's (torch, the trainer,
    CUDA, numpy, Python), as one note; [] when they agree or the checkpoint predates the record."""
    if not saved:
        return []
    now = versions()
    diff = [f"{k} {saved[k]} -> {now[k]}" for k in ("torch", "trainer", "cuda", "numpy", "python")
            if k in saved and saved[k] != now.get(k)]
    return [f"versions changed on resume: {', '.join(diff)} (training goes on; a result bitwise equal to an "
            f"uninterrupted run is promised only on the same versions)"] if diff else []


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
    """torch.save to a temporary file in the same folder, fsync, then rename over path.

    A failed write (disk full, file too large, quota) raises DiskError naming the file (exit RESOURCE); the
    temporary is removed and the previous file at `path` is untouched."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    sink = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            sink = _Sink(fh)
            torch.save(obj, sink)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save turns a failed write into a RuntimeError
        cause = sink.error if sink is not None and sink.error is not None else err
        raise disk_error(path, cause, "checkpoint", f"free space or raise the quota of {path.parent}; the "
                                                    f"checkpoints already there are intact") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class _Sink:
    """A file wrapper that remembers the OSError of a failed write (torch.save reports only its position)."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.fh.flush()


def load(path: str | Path, map_location: str = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely, or raise CheckpointError naming the file."""
    path = Path(path)
    if path.is_dir():
        where = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        inside = sorted(p.name for p in where.glob("*.pt"))
        if not inside:
            raise CheckpointError(f"checkpoint {path}: no checkpoint in it (no *.pt in {where}); a run directory "
                                  f"holds them in checkpoints/ once its first checkpoint is saved")
        hint = f" (there: {', '.join(str(where / n) for n in inside[:4])})"
        raise CheckpointError(f"checkpoint {path} is a directory; give a checkpoint file{hint}")
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
    check_format(ckpt, path)
    return ckpt


def check_format(ckpt: dict[str, Any], path: Any) -> None:
    """Refuse a newer format (NewerCheckpointError, both numbers named) and a file missing keys of its own
    format (CheckpointError: `--resume auto` sets it aside and falls back to the previous checkpoint)."""
    version = ckpt.get("format", 1)
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: checkpoint format {version!r} is not a format number")
    if version > FORMAT_VERSION:
        raise NewerCheckpointError(f"{path} is in checkpoint format {version}; this trainer reads formats 1 to "
                                   f"{FORMAT_VERSION}.\nHINT: resume it with the newer trainer that wrote it "
                                   f"(the file is left as it is).")
    missing = [k for k in FORMAT_KEYS[version] if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(repr(k) for k in missing)} of checkpoint format "
                              f"{version}: damaged or not written by this trainer")


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


def check_id_maps(ckpt: dict[str, Any], maps: dict[str, torch.Tensor], path: Any) -> None:
    """The checkpoint's id maps (data.remap_ids) are the data's: else its rows would mean other users, items
    or entities."""
    saved = ckpt.get("id_maps") or {}
    differ = sorted(k for k in set(saved) | set(maps)
                    if k not in saved or k not in maps or not torch.equal(saved[k].cpu(), maps[k].cpu()))
    if differ:
        raise CheckpointError(f"{path}: its id maps (data.remap_ids) differ from this data's for "
                              f"{', '.join(differ)}: its weights' rows would mean other ids.\nHINT: use the data "
                              f"the checkpoint was trained on (its ids are in RUN_DIR/ids.npz), and the same "
                              f"data.remap_ids")


def step_of(path: Path) -> int:
    """The step number of a periodic checkpoint's name."""
    return int(PERIODIC.match(path.name).group(1))


def set_aside(path: Path, suffix: str) -> Path:
    """Rename path to path+suffix (never over an existing file): kept for inspection, never deleted."""
    target = path.with_name(path.name + suffix)
    n = 1
    while target.exists():
        target, n = path.with_name(f"{path.name}{suffix}.{n}"), n + 1
    os.replace(path, target)
    return target


class CheckpointFolder:
    """Names, writes, prunes and finds the checkpoints of one run directory (rank 0 writes)."""

    def __init__(self, run_dir: str | Path, keep_last: int = 3):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last   # 0: keep every periodic checkpoint

    def periodic_path(self, global_step: int) -> Path:
        """step-00000123.pt."""
        return self.dir / f"step-{global_step:08d}.pt"

    def periodic(self) -> list[Path]:
        """Periodic checkpoints, oldest step first."""
        return sorted((p for p in self.dir.glob("step-*.pt") if PERIODIC.match(p.name)), key=step_of)

    def existing(self) -> list[Path]:
        """Every checkpoint file a run could resume from or overwrite (periodic, best, final)."""
        return sorted(p for p in self.dir.glob("*.pt") if p.is_file()) if self.dir.is_dir() else []

    def save(self, state: dict[str, Any], kind: str) -> Path:
        """kind: 'periodic', 'best' or 'final'. Older periodic files beyond keep_last are removed."""
        path = self.periodic_path(state["global_step"]) if kind == "periodic" else self.dir / f"{kind}.pt"
        atomic_save(state, path)
        if kind == "periodic":
            self._prune(path)
        return path

    def _prune(self, written: Path) -> None:
        """Remove the oldest periodic files older than `written`: never `written` itself, never a newer one
        (files of a higher step are not this run's history; resume() sets them aside instead)."""
        if self.keep_last <= 0:
            return
        older = [p for p in self.periodic() if step_of(p) < step_of(written)]
        for old in older[: max(len(older) - (self.keep_last - 1), 0)]:
            old.unlink(missing_ok=True)

    def remove_temporaries(self) -> list[Path]:
        """Delete the temporaries of saves that were killed half-way (they never become checkpoints)."""
        found = [p for p in self.dir.glob(".*.tmp.*") if TEMPORARY.match(p.name)] if self.dir.is_dir() else []
        for tmp in found:
            tmp.unlink(missing_ok=True)
            log.warning("removed %s, the temporary of a checkpoint save that was interrupted", tmp)
        return found

    def set_aside_damaged(self, damaged: list[Path]) -> None:
        """The damaged checkpoints newest_valid skipped, moved aside as *.corrupt now that the run goes on."""
        for path in damaged:
            if path.exists():
                log.warning("%s does not load; moved aside as %s", path, set_aside(path, ".corrupt").name)

    def set_aside_newer(self, step: int, resumed: str | Path, recipe: str | None = None) -> list[Path]:
        """After resuming `resumed` at `step`: periodic/final files of a later step belong to an abandoned
        history; rename them *.superseded so that neither pruning nor a later `--resume auto` picks them. A
        checkpoint of another recipe is named as such (and set aside as *.other-recipe)."""
        moved = []
        for path in self.candidates():
            if path.resolve() == Path(resumed).resolve():
                continue
            try:
                header = torch.load(path, map_location="cpu", weights_only=True, mmap=True)   # tensors not read
                other = recipe is not None and header.get("recipe") not in (None, recipe)
                later = (step_of(path) if PERIODIC.match(path.name) else int(header["global_step"])) > step
            except Exception:  # unreadable: newest_valid sets it aside when it meets it
                continue
            if other:
                moved.append(set_aside(path, ".other-recipe"))
                log.warning("%s is a checkpoint of recipe %r, not of this run's %r: kept as %s", path,
                            header.get("recipe"), recipe, moved[-1].name)
            elif later:
                moved.append(set_aside(path, ".superseded"))
                log.warning("%s is from a later step than the resumed one (%d): kept as %s", path, step,
                            moved[-1].name)
        return moved

    def candidates(self) -> list[Path]:
        """Resumable checkpoints, newest first (final, then periodic by step)."""
        final = [self.dir / "final.pt"] if (self.dir / "final.pt").exists() else []
        return final + self.periodic()[::-1]

    def newest_valid(self, damaged: list[Path] | None = None) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads. Truncated or corrupt ones are moved aside as *.corrupt (kept,
        never deleted) with a warning, so that neither a requeue nor pruning meets them again; or, given a list
        `damaged`, only named there, to be set aside once nothing refuses the run (set_aside_damaged)."""
        best: tuple[int, Path, dict] | None = None
        for path in self.candidates():
            try:
                ckpt = load(path)
            except NewerCheckpointError:
                raise                     # a newer trainer's checkpoint: stop, and leave it where it is
            except CheckpointError as err:
                if damaged is None:
                    log.warning("skipping %s; moved aside as %s", err, set_aside(path, ".corrupt").name)
                else:
                    log.warning("skipping %s", err)
                    damaged.append(path)
                continue
            if best is None or ckpt["global_step"] > best[0]:
                best = (ckpt["global_step"], path, ckpt)
            if path.name != "final.pt":
                break
        return (best[1], best[2]) if best else None


def refuse_fresh_run(run_dir: str | Path) -> None:
    """A run without --resume must not start in a run directory that already holds checkpoints: its
    periodic files would interleave with the old ones and best/final would be overwritten."""
    found = CheckpointFolder(run_dir).existing()
    if found:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise CheckpointError(f"run directory {run_dir} already holds checkpoints ({names}) and this run "
                              f"was started without --resume.\nHINT: continue that run with --resume auto, "
                              f"or start a new one with another --run-dir.")


def checkpoint_for_eval(path: str, overrides: list[str]) -> tuple[Path, dict]:
    """--checkpoint: a checkpoint file, or a run directory (its best.pt, else final.pt; a best.pt that cannot
    be read falls back to final.pt with a warning naming both), loaded. Paths among the overrides mean a shell
    glob matched several: refused by name rather than taken for the first."""
    globbed = [o for o in overrides if "=" not in o and Path(o).exists()]
    if globbed:
        raise CheckpointError(f"--checkpoint matched {len(globbed) + 1} paths ({', '.join([path, *globbed])}): "
                                      f"a glob of the shell, most likely.\nHINT: name one run directory or file.")
    given = Path(path)
    if not given.is_dir():
        return given, load(given)
    folder = given / "checkpoints" if (given / "checkpoints").is_dir() else given
    found = [folder / name for name in ("best.pt", "final.pt") if (folder / name).is_file()]
    for k, candidate in enumerate(found):
        try:
            return candidate, load(candidate)
        except NewerCheckpointError:
            raise
        except CheckpointError as err:
            if k + 1 == len(found):
                raise
            print(f"warning: {err}; evaluating {found[k + 1]} instead", file=sys.stderr)
    return given, load(given)        # which says what the directory holds

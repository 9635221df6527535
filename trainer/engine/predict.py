"""`python -m trainer predict`: a checkpoint turned into predictions, on one process or many ranks.

    python -m trainer predict --checkpoint runs/sasrec --out top10.csv --top-k 10
    torchrun --nproc-per-node 4 -m trainer predict --checkpoint runs/sasrec --out top10.parquet --users ids.txt

The recipe lists its units (users, videos, recordings) the same way on every rank and turns a slice of them into
rows (Recipe.predict_units / predict_rows); parts.py splits the units into parts, writes each rank's parts and
joins them. The model is the checkpoint's (best.pt, else final.pt, as `eval` takes it), in eval mode, without DDP.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.engine.predict_parts import Parts, PredictError, check_out

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class PredictRequest:
    """What was asked (the predict command's flags), as the recipes read it."""

    top_k: int = 10
    data: str = ""              # the data to predict for ("": the checkpoint's own data.path)
    users: str = ""             # a file of user ids, one per line ("": every user of the data)
    keep_seen: bool = False     # recommenders: items the user has seen may be recommended again
    history: str = "full"       # sasrec: full (every known item) or train (the training part, as eval's val input)
    unknown_users: str = "skip"  # kgat: listed users the checkpoint never saw: skip, or popular (cold start)


def request_of(args) -> PredictRequest:
    if args.top_k < 1:
        raise PredictError(f"--top-k {args.top_k}: must be at least 1")
    if args.users and not Path(args.users).is_file():
        raise PredictError(f"--users {args.users}: no such file (one user id per line)")
    if args.data and not Path(args.data).exists():
        raise PredictError(f"--data {args.data}: no such file or folder")
    return PredictRequest(top_k=args.top_k, data=args.data or "", users=args.users or "", keep_seen=args.keep_seen,
                          history=args.history, unknown_users=args.unknown_users)


@dataclass(frozen=True)
class PredictOutcome:
    """How a predict ended on this rank: done (OUT written, by rank 0) or stopped by a signal (code: 0 when this
    rank requeued the job, else 128 + the signal)."""

    status: str
    code: int
    out: str = ""


def run_predict(args) -> PredictOutcome:
    """The predict command on this rank: the checkpoint's model over this rank's parts, then (rank 0) the join."""
    from trainer.config.registry import get_spec
    from trainer.distributed import runtime
    from trainer.distributed.environment import select_environment
    from trainer.engine import ckpt_io
    from trainer.engine.build import checkpoint_config, loaded_for_eval
    from trainer.engine.logging import setup_logging
    from trainer.engine.session import build_recipe
    request = request_of(args)
    out = Path(args.out)
    check_out(out, args.overwrite)                  # before anything is loaded: a wrong name fails at once
    path, ckpt = ckpt_io.checkpoint_for_eval(args.checkpoint, args.overrides)
    cfg = checkpoint_config(ckpt, args.overrides)
    info = runtime.init(select_environment(), cfg.dist)
    ok = False
    try:
        setup_logging(info)
        run = loaded_for_eval(build_recipe(cfg, info, get_spec(cfg.recipe)), info, cfg, ckpt, path)
        outcome = _predict(run, args, request, dict(checkpoint=str(Path(path).resolve()),
                                                    step=int(ckpt["global_step"]), recipe=cfg.recipe))
        ok = True
    finally:
        runtime.teardown(info, clean=ok)
    return outcome


def _predict(run, args, request: PredictRequest, source: dict) -> PredictOutcome:
    """The parts of this rank, written one by one (a signal stops it after the current one), then the join."""
    from trainer.distributed import runtime
    from trainer.engine.capabilities import Prediction, of
    from trainer.engine.preemption import PreemptionHandler
    from trainer.engine.recipe import unwrap
    info, recipe, model = run.info, of(run.recipe, Prediction), unwrap(run.model).eval()
    units = recipe.predict_units(request)
    if len(units) == 0:
        raise PredictError(f"{request.data or run.cfg.data.path or 'the data'}: nothing to predict for")
    size = max(1, args.part_size)
    manifest = dict(source, units=len(units), part_size=size, request=request.__dict__, overrides=list(args.overrides))
    parts = Parts(Path(args.out), manifest, -(-len(units) // size), keep_parts=args.parts)
    parts.open(args.overwrite, info.is_main)
    runtime.barrier(info)
    done, mine = parts.done(), parts.todo(info.rank, info.world_size)
    if info.is_main:
        log.info("predicting %s for %d %s from %s (step %d): %d parts of %d, %d already written in %s%s",
                 source["recipe"], len(units), recipe.predict_unit_name, source["checkpoint"], source["step"],
                 parts.count, size, done, parts.folder, " (continuing)" if done else "")
    start = time.perf_counter()
    signals = PreemptionHandler().install()
    try:
        with torch.inference_mode():
            for n, i in enumerate(mine):
                parts.write(i, recipe.predict_rows(model, units[i * size:(i + 1) * size], request))
                if signals.received:
                    return PredictOutcome("stopped", stopped(signals.received, info, n + 1, len(mine), parts))
                if info.is_main and (n + 1) % max(1, len(mine) // 10) == 0:
                    log.info("part %d/%d of rank 0 written (%.1f s)", n + 1, len(mine), time.perf_counter() - start)
    finally:
        signals.restore()
    runtime.barrier(info)
    if not info.is_main:
        return PredictOutcome("done", 0)
    where = str(parts.join())
    log.info("predictions of %d %s: %s (%.1f s)", len(units), recipe.predict_unit_name, where,
             time.perf_counter() - start)
    print(f"wrote {where}")
    return PredictOutcome("done", 0, where)


def stopped(signum: int, info, written: int, owned: int, parts: Parts) -> int:
    """A signal (Slurm's time-limit warning, a preemption, scancel) came: this rank stops after the part it was
    writing; rank 0 requeues the job on USR1/USR2 as training does (SIGTERM: Slurm requeues or cancels)."""
    import signal as signals

    from trainer.engine.preemption import requeue_slurm_job
    name = signals.Signals(signum).name
    log.warning("%s: rank %d stops after %d of its %d parts (%s); a rerun continues from the parts written", name,
                info.rank, written, owned, parts.folder)
    job = info.requeue_id if info.can_requeue else None
    if info.is_main and job and signum != signals.SIGTERM and requeue_slurm_job(job):
        log.info("job %s requeued", job)
        return 0
    return 128 + signum


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's k highest scores, highest first; ties go to the lower index. topk picks
    among tied scores as it likes: a row whose k-th and (k+1)-th scores tie is sorted whole (stable) instead."""
    k = min(k, scores.shape[1])
    probe = min(k + 1, scores.shape[1])
    values, index = torch.topk(scores, probe, dim=1)
    order = torch.argsort(index, dim=1)                         # by index, then (stable) by score
    values, index = values.gather(1, order), index.gather(1, order)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    values, index = values.gather(1, order), index.gather(1, order)
    if probe > k:
        tied = (values[:, k - 1] == values[:, k]).nonzero()[:, 0]
        if len(tied):
            full = torch.sort(scores[tied], dim=1, descending=True, stable=True)
            values[tied], index[tied] = full.values[:, :probe], full.indices[:, :probe]
    return values[:, :k], index[:, :k]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()

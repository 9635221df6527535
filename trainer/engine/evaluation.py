"""Evaluation sharded across ranks: each rank sums additive statistics over its shard, the sums are
all-reduced, and the recipe turns them into metrics; so it gets faster with more ranks. A training run's
evaluations (Evaluations) also log what they found.

    metrics = evaluate_split(run, "val")                 # a built run (trainer/engine/build.py)
    evaluations = Evaluations(run, state, writer, {})    # a training run's: metrics.jsonl, TensorBoard, console
    evaluations.evaluate("val", epoch=3)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine import ckpt_io
from trainer.engine.callbacks import Phases
from trainer.engine.capabilities import Batching, DDPPolicy, Evaluation, of
from trainer.engine.loader import ShardSampler, make_loader
from trainer.engine.logging import MetricsWriter
from trainer.engine.recipe import Recipe, move_to
from trainer.engine.state import TrainState

log = logging.getLogger(__name__)


class EvalProgress:
    """Rank 0's line every EVERY_S seconds of a long evaluation (a full ranking over a large catalogue runs for
    minutes, which looked like a hang): batches of its shard done, the share, the seconds so far."""

    EVERY_S = 30.0

    def __init__(self, batches: int, shown: bool, clock: Callable[[], float] = time.monotonic):
        self.batches, self.shown, self.clock = batches, shown, clock
        self.done, self.start = 0, clock()
        self.next = self.start + self.EVERY_S

    def step(self) -> str | None:
        """One batch done; the line logged, where one was due."""
        self.done += 1
        now = self.clock()
        if not self.shown or now < self.next or self.done >= self.batches:
            return None
        self.next = now + self.EVERY_S
        line = (f"evaluating: {self.done} of {self.batches} batches of this rank's shard "
                f"({100 * self.done / max(self.batches, 1):.0f}%), {now - self.start:.0f} s")
        log.info("%s", line)
        return line


@torch.no_grad()
def evaluate(recipe: Recipe, model: torch.nn.Module, dataset, info: DistInfo, batch_size: int,
             num_workers: int, autocast: Callable, phases: Phases | None = None, split: str = "") -> dict[str, Any]:
    """Metrics of `dataset` (every sample exactly once over all ranks); `phases` is told of the evaluation's start,
    each batch and end (the components' evaluation_* hooks), of the recipe's evaluation start (a long phase) and of
    each batch done (a mark: the hang watch's progress)."""
    phases = phases or Phases()
    phases.tell("evaluation_start", split)
    sampler = ShardSampler(len(dataset), info.rank, info.world_size)
    loader = make_loader(dataset, sampler, batch_size, num_workers, of(recipe, Batching).collate_fn(), 0)
    hooks = of(recipe, Evaluation)
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with phases.long("recipe.on_evaluation_start"):
        hooks.on_evaluation_start(model)
    progress = EvalProgress(len(loader), info.is_main)
    try:
        for batch in loader:
            with autocast():
                stats = recipe.eval_step(model, move_to(batch, info.torch_device))
            for key, value in stats.items():
                value = value.detach().to("cpu", torch.float64)
                totals[key] = totals[key] + value if key in totals else value
            phases.mark("evaluation batch", schedule=False)      # the shards may differ by a batch
            phases.tell("evaluation_batch", split)
            progress.step()
    finally:
        hooks.on_evaluation_end()
        model.train(was_training)
    phases.mark("evaluation done")          # before the ranks' totals meet
    metrics = recipe.compute_metrics(reduce_totals(totals, info))
    phases.tell("evaluation_end", split, metrics)
    return metrics


def reduce_totals(totals: dict[str, torch.Tensor], info: DistInfo) -> dict[str, torch.Tensor]:
    """Sum statistics over ranks; a rank with an empty shard contributes zeros of the right shapes."""
    if not info.distributed:
        return totals
    shapes: dict[str, tuple] = {}
    for rank_shapes in runtime.all_gather_object({k: tuple(v.shape) for k, v in totals.items()}, info):
        shapes.update(rank_shapes)
    out = {}
    for key in sorted(shapes):
        value = totals.get(key, torch.zeros(shapes[key], dtype=torch.float64))
        out[key] = runtime.all_reduce(value.to(runtime.comm_device(info)), info).cpu()
    return out


def evaluate_split(run, split: str) -> dict[str, Any]:
    """Metrics of one evaluation split of a built run (trainer/engine/build.py), sharded across ranks."""
    return evaluate(run.recipe, run.eval_model, run.eval_sets[split], run.info, run.eval_batch_size,
                    run.cfg.train.num_workers, run.autocast, run.phases, split)


def metrics_table(results: dict[str, dict[str, Any]]) -> str:
    """The scalar metrics of each split as a compact table (a metric per row, a split per column); per-class
    scores and matrices go to the JSON report."""
    splits = list(results)
    names = [k for k in dict.fromkeys(k for r in results.values() for k in r)
             if "/" not in k and all(isinstance(r.get(k), (int, float, type(None))) for r in results.values())]
    width = max([len(n) for n in names] + [6])
    lines = [f"{'metric':<{width}}  " + "  ".join(f"{s:>10}" for s in splits)]
    for name in names:
        cells = []
        for split in splits:
            value = results[split].get(name)
            cells.append(f"{'-' if value is None else value:>10}" if not isinstance(value, float)
                         else f"{value:>10.4f}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def metrics_line(metrics: dict[str, Any]) -> str:
    """A split's float metrics as `name value` pairs in name order, four decimals (the figures `trainer eval` prints in
    its table), not a Python dict."""
    return "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if isinstance(v, float) and "/" not in k)


class Evaluations:
    """A training run's evaluations, each logged (metrics.jsonl, TensorBoard, console and the recipe's plots on rank
    0); last_metrics holds each split's latest (saved in every checkpoint), last_records as written."""

    def __init__(self, run, state: TrainState, writer: MetricsWriter, last_metrics: dict[str, dict[str, Any]]):
        self.run, self.state, self.writer = run, state, writer
        self.last_metrics = last_metrics
        self.last_records: dict[str, dict[str, Any]] = {}

    def evaluate(self, split: str, epoch: int, **tags: Any) -> dict[str, Any]:
        """Evaluate a split and log it (epoch: the one just trained; tags: extra fields of its record)."""
        run, t0 = self.run, time.perf_counter()
        if of(run.recipe, DDPPolicy).buffers_before_eval and isinstance(run.wrapped, DDP):
            for buf in run.model.buffers():
                runtime.broadcast(buf, run.info)
        metrics = self.last_metrics[split] = evaluate_split(run, split)
        self.last_records[split] = dict(metrics, eval_time_s=round(time.perf_counter() - t0, 4), **tags)
        self.writer.write(split, epoch, self.state.global_step, self.last_records[split])
        if run.info.is_main:
            which = f" ({tags['checkpoint']} checkpoint)" if "checkpoint" in tags else ""
            log.info("%s%s after epoch %d (%.1f s): %s", split, which, epoch, time.perf_counter() - t0,
                     metrics_line(metrics))
            with run.phases.long("recipe.after_evaluation"):
                pngs = of(run.recipe, Evaluation).after_evaluation(split, metrics, str(run.cfg.run_dir), epoch) or ()
            for png in pngs:
                self.writer.image(f"{split}/{Path(png).stem}", png, self.state.global_step)
        return metrics

    def test_best(self, best: Path, epoch: int) -> dict[str, Any]:
        """The test split with the best checkpoint's weights (the final test's, when the final weights are the best)."""
        ckpt = ckpt_io.load(best)
        if ckpt["global_step"] == self.state.global_step:   # the final weights are the best
            log.info("test (best checkpoint): the final checkpoint (step %d), the same metrics", ckpt["global_step"])
            self.writer.write("test", epoch, self.state.global_step, dict(self.last_records["test"], checkpoint="best"))
            return dict(self.last_metrics["test"])
        self.run.model.load_state_dict(ckpt["model"])
        return self.evaluate("test", epoch, checkpoint="best")

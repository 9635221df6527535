"""Evaluation sharded across ranks: each rank sums additive statistics over its shard, the sums are
all-reduced, and the recipe turns them into metrics; so it gets faster with more ranks."""
from __future__ import annotations

from typing import Any, Callable

import torch

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine.loader import ShardSampler, make_loader
from trainer.engine.recipe import Recipe, move_to


@torch.no_grad()
def evaluate(recipe: Recipe, model: torch.nn.Module, dataset, info: DistInfo, batch_size: int,
             num_workers: int, autocast: Callable) -> dict[str, Any]:
    """Metrics of `dataset` (every sample exactly once over all ranks)."""
    sampler = ShardSampler(len(dataset), info.rank, info.world_size)
    loader = make_loader(dataset, sampler, batch_size, num_workers, recipe.collate_fn(), 0)
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    recipe.on_evaluation_start(model)
    try:
        for batch in loader:
            with autocast():
                stats = recipe.eval_step(model, move_to(batch, info.torch_device))
            for key, value in stats.items():
                value = value.detach().to("cpu", torch.float64)
                totals[key] = totals[key] + value if key in totals else value
    finally:
        recipe.on_evaluation_end()
        model.train(was_training)
    return recipe.compute_metrics(reduce_totals(totals, info))


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
                    run.cfg.train.num_workers, run.autocast)


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

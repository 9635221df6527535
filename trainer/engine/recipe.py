"""The core a recipe implements (its optional capabilities: trainer/engine/capabilities.py), and the batch helpers
the engine and recipes share.

    class MyRecipe(Recipe):          # trainer/recipes/<name>/recipe.py; its spec.py registers it
        def build_datasets(self): ...
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from trainer.config.sections import OptimConfig


class Recipe:
    """The core of a recipe: its data, its model, a training step, an evaluation step and its metrics; the engine
    does the rest. Everything else a recipe may do is an optional capability it opts into by inheriting it
    (trainer/engine/capabilities.py: Batching, DeviceResident, EpochPlan, Evaluation, Prediction, MemoryEstimate,
    DDPPolicy, GPUShapedStep, OwnOptimizer, DataProvenance; docs/extending.md, "Capabilities").

    The engine calls build_datasets(), build_model(), then per step training_step(model, batch) and per evaluation
    eval_step(model, batch) -> sums, then compute_metrics(the sums reduced over every batch of every rank).
    """

    primary_metric: ClassVar[tuple[str, str]] = ("loss", "min")   # (val metric, "min" | "max"): picks best.pt

    def __init__(self, data_cfg: Any, model_cfg: Any, train_cfg: Any, dist: Any, eval_cfg: Any = None,
                 seed: int = 0, loss_cfg: Any = None, optim_cfg: Any = None):
        self.data_cfg, self.model_cfg, self.train_cfg, self.dist = data_cfg, model_cfg, train_cfg, dist
        self.eval_cfg, self.loss_cfg, self.seed = eval_cfg, loss_cfg, seed
        self.optim_cfg = optim_cfg if optim_cfg is not None else OptimConfig()   # optim.*: the optimizer's memory

    def build_datasets(self) -> tuple[torch.utils.data.Dataset, dict[str, torch.utils.data.Dataset]]:
        """(training set, {"val": ..., "test": ...}); evaluation sets may be empty."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """The plain nn.Module (the engine wraps it in DDP/DP)."""
        raise NotImplementedError

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of the batch; call model(...) so DDP hooks run."""
        raise NotImplementedError

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Additive statistics of the batch (sums, counts, confusion matrices)."""
        raise NotImplementedError

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Metrics from the statistics summed over every batch of every rank."""
        raise NotImplementedError


def map_tensors(batch: Any, fn) -> Any:
    """fn applied to every tensor of a (nested) batch, the nesting and the other leaves kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) batch, in map_tensors' order."""
    found: list[torch.Tensor] = []
    map_tensors(batch, found.append)
    return found


def move_to(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a (nested) batch to device."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP/DataParallel (for attributes such as embeddings)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) \
        and inner is not None else model

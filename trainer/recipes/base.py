"""The Recipe protocol and the registry of recipes by name.

A recipe builds its data, model, loss and evaluator from its own config sections only. Built-in
recipes are listed by import path (nothing heavy is imported to list them); out-of-tree recipes are
loaded from the modules named in TRAINER_PLUGINS (comma-separated), which call register_recipe().
"""
from __future__ import annotations

import importlib
import os
from typing import Any, ClassVar, Sequence

import torch

from trainer.config import EmptyConfig

_BUILTIN: dict[str, str] = {          # name -> "module:Class" (imported on first use)
    "har": "trainer.recipes.har.recipe:HARRecipe",
    "kgat": "trainer.recipes.kgat.recipe:KGATRecipe",
    "sasrec": "trainer.recipes.sasrec.recipe:SASRecRecipe",
    "video": "trainer.recipes.video.recipe:VideoRecipe",
}
_REGISTRY: dict[str, Any] = {}
_PLUGINS_LOADED: set[str] = set()


def register_recipe(name: str, target: Any = None):
    """Register a Recipe class (or 'module:Class') under name; usable as a decorator."""
    def deco(obj):
        _REGISTRY[name] = obj
        if isinstance(obj, type):
            obj.name = name
        return obj
    return deco(target) if target is not None else deco


def _load_plugins() -> None:
    """Import the modules listed in TRAINER_PLUGINS once each."""
    for mod in filter(None, (m.strip() for m in os.environ.get("TRAINER_PLUGINS", "").split(","))):
        if mod not in _PLUGINS_LOADED:
            _PLUGINS_LOADED.add(mod)
            importlib.import_module(mod)


def recipe_names() -> list[str]:
    """Every registered recipe name, sorted."""
    _load_plugins()
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def get_recipe_class(name: str) -> type["Recipe"]:
    """The Recipe class registered under name, or a ValueError listing the known names."""
    _load_plugins()
    target = _REGISTRY.get(name, _BUILTIN.get(name))
    if target is None:
        raise ValueError(f"unknown recipe {name!r}; registered recipes: {', '.join(recipe_names()) or 'none'}")
    if isinstance(target, str):
        module, attr = target.split(":")
        target = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = target
        target.name = name
    return target


class Recipe:
    """Base class: subclasses define data, model, loss and metrics; the engine does the rest.

    Hooks the engine calls, in order: build_datasets(), build_model(), then per step
    training_step(model, batch) and per evaluation eval_step(model, batch) -> sums, then
    compute_metrics(reduced sums). on_epoch_start/on_epoch_end let a recipe with a special epoch
    (extra phases, refreshed state) do its work without the loop knowing the recipe.
    """

    name: ClassVar[str] = "base"
    data_config: ClassVar[type] = EmptyConfig
    model_config: ClassVar[type] = EmptyConfig
    eval_config: ClassVar[type] = EmptyConfig
    primary_metric: ClassVar[tuple[str, str]] = ("loss", "min")   # (val metric, "min" | "max")
    tie_break_metric: ClassVar[tuple[str, str] | None] = None     # decides between equal primary values
    find_unused_parameters: ClassVar[bool] = False   # DDP: some steps leave parameters without gradients
    broadcast_buffers: ClassVar[bool] = True         # DDP: rank 0's buffers to every rank before each forward
    defaults: ClassVar[dict[str, Any]] = {}          # dotted keys over the engine's defaults (below YAML)

    def __init__(self, data_cfg: Any, model_cfg: Any, train_cfg: Any, dist: Any, eval_cfg: Any = None,
                 seed: int = 0):
        self.data_cfg, self.model_cfg, self.train_cfg, self.dist = data_cfg, model_cfg, train_cfg, dist
        self.eval_cfg = eval_cfg if eval_cfg is not None else self.eval_config()
        self.seed = seed

    def build_datasets(self) -> tuple[torch.utils.data.Dataset, dict[str, torch.utils.data.Dataset]]:
        """(training set, {"val": ..., "test": ...}); evaluation sets may be empty."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """The plain nn.Module (the engine wraps it in DDP/DP)."""
        raise NotImplementedError

    def collate_fn(self):
        """DataLoader collate function (None: torch's default)."""
        return None

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of the batch; call model(...) so DDP hooks run."""
        raise NotImplementedError

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Additive statistics of the batch (sums, counts, confusion matrices)."""
        raise NotImplementedError

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Metrics from the statistics summed over every batch of every rank."""
        raise NotImplementedError

    def batch_size_of(self, batch: Any) -> int:
        """Number of samples in a batch (for throughput)."""
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) \
            if isinstance(batch, dict) else batch
        return int(first.shape[0])

    def build_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer | None:
        """A recipe-specific optimizer at the (world-size scaled) lr; None: the engine's train.optimizer."""
        return None

    def epoch_batches(self, epoch: int) -> Sequence[Any] | None:
        """This rank's batches of an epoch that is not one pass over the training set (same length every
        epoch, any index reproducible on its own so a run resumes mid-epoch); None: the engine samples."""
        return None

    def on_epoch_start(self, epoch: int, model: torch.nn.Module) -> None:
        """Called before each training epoch."""

    def on_epoch_end(self, epoch: int, model: torch.nn.Module) -> None:
        """Called after each training epoch, before evaluation."""

    def epoch_metrics(self) -> dict[str, float]:
        """Every rank, after on_epoch_end: extra training metrics of the epoch (reduced by the recipe)."""
        return {}

    def on_evaluation_start(self, model: torch.nn.Module) -> None:
        """Every rank, before the batches of an evaluation (e.g. cache embeddings shared by all batches)."""

    def on_evaluation_end(self) -> None:
        """Every rank, after an evaluation (release what on_evaluation_start cached)."""

    def after_evaluation(self, split: str, metrics: dict[str, Any], run_dir: str, epoch: int) -> None:
        """Rank 0 only: write plots or tables for the metrics of a split."""


def move_to(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor of a (nested) batch to device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device, non_blocking) for v in batch)
    return batch




def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside DDP/DataParallel (for attributes such as embeddings)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) \
        and inner is not None else model

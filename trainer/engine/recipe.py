"""The interface a recipe implements, and the batch helpers the engine and recipes share.

    class MyRecipe(Recipe):          # trainer/recipes/<name>/recipe.py; its spec.py registers it
        def build_datasets(self): ...
"""
from __future__ import annotations

from typing import Any, ClassVar, Collection, Protocol, Sequence

import torch

from trainer.config.sections import OptimConfig


class DeviceData(Protocol):
    """A training set held on the training device (Recipe.device_dataset): a batch is a gather of its indices."""

    def gather(self, index: torch.Tensor, epoch: int) -> Any: ...

    def __len__(self) -> int: ...


class Recipe:
    """Base class: subclasses define data, model, loss and metrics; the engine does the rest.

    Hooks the engine calls, in order: build_datasets(), build_model(), then per step
    training_step(model, batch) and per evaluation eval_step(model, batch) -> sums, then
    compute_metrics(reduced sums). on_epoch_start/on_epoch_end let a recipe with a special epoch
    (extra phases, refreshed state) do its work without the loop knowing the recipe.
    """

    primary_metric: ClassVar[tuple[str, str]] = ("loss", "min")   # (val metric, "min" | "max")
    tie_break_metric: ClassVar[tuple[str, str] | None] = None     # decides between equal primary values
    find_unused_parameters: ClassVar[bool] = False   # DDP: some steps leave parameters without gradients
    # instead of DDP: every gradient averaged in one all-reduce after the backward (no buckets, no per-bucket
    # synchronisation, no search for unused parameters); for models whose steps use different parameters
    average_after_backward: ClassVar[bool] = False
    broadcast_buffers: ClassVar[bool] = True         # DDP: rank 0's buffers to every rank before each forward
    buffers_before_eval: ClassVar[bool] = False      # instead: rank 0's buffers to every rank before evaluating
    reuse_freed_memory: ClassVar[bool] = True        # steps free and remake large tensors: trainer/native/memory.py

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

    def collate_fn(self):
        """DataLoader collate function (None: torch's default)."""
        return None

    def data_files(self) -> list:
        """The files this run's data was read from (its fingerprint, in every checkpoint): by default those of
        data.path (trainer/data/fingerprint.py files_under); none for generated data."""
        from trainer.data.fingerprint import files_under
        path = getattr(self.data_cfg, "path", "")
        return files_under(path) if path else []

    def data_counts(self) -> dict[str, int]:
        """The data's sizes that the checkpoint records beside its files (users, items, interactions, classes)."""
        return {}

    def model_for_estimate(self) -> torch.nn.Module:
        """The model with its shapes and no storage (the meta device), for the memory estimate made before the
        model is built (trainer/engine/footprint.py); a recipe whose build_model reads tensor values overrides it."""
        with torch.device("meta"):
            return self.build_model()

    def optimizer_states(self) -> int:
        """How many copies of the weights the optimizer keeps (Adam/AdamW: 2; SGD: its momentum, if any)."""
        oc = self.optim_cfg
        return 2 if oc.name in ("adam", "adamw") else int(bool(getattr(oc, "momentum", 0)))

    def memory_drivers(self) -> str:
        """The settings and data sizes that set the model's size, for the message of a model that cannot fit."""
        return "the model.* settings"

    def before_step(self, batch: Any) -> None:
        """Host-side work of a micro-batch before its training_step (which compile.mode traces: a clock read
        or an optimizer's phase switch there would break its graph)."""

    def after_step(self) -> None:
        """After training_step returned, outside compile.mode's graph: a CUDA-graph replay's outputs that the
        recipe keeps are read here, before the next replay writes over them."""

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of the batch; call model(...) so DDP hooks run."""
        raise NotImplementedError

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Additive statistics of the batch (sums, counts, confusion matrices)."""
        raise NotImplementedError

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Metrics from the statistics summed over every batch of every rank."""
        raise NotImplementedError

    def metric_names(self) -> Collection[str] | None:
        """The names of the validation metrics, known before any evaluation (built data, no model run): a
        train.select_metric outside them is refused before the run writes anything. None: not known before the first
        validation (the setting is checked then)."""
        return None

    def batch_size_of(self, batch: Any) -> int:
        """Number of samples in a batch (for throughput)."""
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) \
            if isinstance(batch, dict) else batch
        return int(first.shape[0])

    @property
    def gpu_shaped(self) -> bool:
        """Whether this run takes the GPU-shaped step (train.gpu_path; auto: on a CUDA device): fixed shapes and
        no host read inside a step, where a recipe's CPU path packs, buckets or loops on data-dependent sizes."""
        mode = getattr(self.train_cfg, "gpu_path", "auto")
        return mode == "on" or (mode == "auto" and str(getattr(self.dist, "device", "cpu")).startswith("cuda"))

    def device_dataset(self) -> DeviceData | None:
        """The training set held on the training device (an object with `gather(index, epoch)` -> batch and
        len(); engine.loader.TensorBatches for plain tensors): the engine's sampler picks the indices and a batch
        is a gather, with no DataLoader and no copy per step. None (the default): the DataLoader path."""
        return None

    def build_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer | None:
        """A recipe-specific optimizer at the (world-size scaled) lr; None: the engine's optim.name."""
        return None

    def sample_costs(self) -> Sequence[float] | None:
        """Per training sample, a work estimate (e.g. a sequence length): under DDP each global batch is then
        dealt to the ranks by cost, so no rank waits for one that drew the long samples. None: all alike."""
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

    def id_maps(self) -> dict[str, Any]:
        """The original id of each id, per kind, where the recipe compacted sparse ids (data.remap_ids): saved
        in RUN_DIR/ids.npz and every checkpoint, and checked against the data on resume and eval."""
        return {}

    predict_unit_name = "items"    # what predict_units lists, for the log ("users", "videos", "recordings")

    def predict_units(self, request: Any) -> Sequence[Any]:
        """`trainer predict`: what to predict for (users, videos, ...), the same list on every rank (the command
        cuts it into parts). request: engine/predict.PredictRequest."""
        from trainer.engine.predict_parts import PredictError
        raise PredictError(f"{type(self).__name__}: predict is not available for this recipe yet")

    def predict_rows(self, model: torch.nn.Module, units: Sequence[Any], request: Any) -> dict[str, Any]:
        """The output columns (equal-length arrays) for a slice of predict_units, the model in eval mode."""
        raise NotImplementedError

    def after_evaluation(self, split: str, metrics: dict[str, Any], run_dir: str, epoch: int) -> Sequence[Any]:
        """Rank 0 only: write plots or tables for the metrics of a split; returns the PNG files written (the
        engine also shows them in TensorBoard)."""
        return ()


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

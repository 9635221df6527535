"""What a recipe may do beyond its core (trainer/engine/recipe.py Recipe): each capability a small protocol with the
engine's defaults, which a recipe opts into by inheriting it and overriding what it needs (docs/extending.md,
"Capabilities", lists the built-in recipes that use each).

    class MyRecipe(Recipe, EpochPlan, Prediction):      # the core, plus the epoch hooks and `trainer predict`
        def on_epoch_start(self, epoch, model): ...

The engine reads a capability through `of(recipe, Capability)`: the recipe itself where it inherits the capability,
else a view that takes each member from the recipe where it defines it (a recipe written before the
capabilities, overriding the member under the same name, keeps working) and the capability's default otherwise.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar, Collection, Protocol, Sequence, TypeVar

import torch

T = TypeVar("T")


class DeviceData(Protocol):
    """A training set held on the training device (DeviceResident.device_dataset): a batch is a gather of its
    indices."""

    def gather(self, index: torch.Tensor, epoch: int) -> Any: ...

    def __len__(self) -> int: ...


class Batching:
    """Batches that are not a tensor tuple of torch's default collation (sasrec, kgat)."""

    def collate_fn(self):
        """DataLoader collate function (None: torch's default)."""
        return None

    def batch_size_of(self, batch: Any) -> int:
        """Number of samples in a batch (for throughput)."""
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values())) \
            if isinstance(batch, dict) else batch
        return int(first.shape[0])

    def sample_costs(self) -> Sequence[float] | None:
        """Per training sample, a work estimate (e.g. a sequence length): under DDP each global batch is then
        dealt to the ranks by cost, so no rank waits for one that drew the long samples. None: all alike."""
        return None


class DeviceResident:
    """The training set held on the training device (har, sasrec)."""

    def device_dataset(self) -> DeviceData | None:
        """The training set held on the training device (an object with `gather(index, epoch)` -> batch and
        len(); engine.loader.TensorBatches for plain tensors): the engine's sampler picks the indices and a batch
        is a gather, with no DataLoader and no copy per step. None (the default): the DataLoader path."""
        return None


class EpochPlan:
    """An epoch with work of its own: hooks around it, its own batches, its own training metrics (every built-in
    recipe; kgat draws its own batches)."""

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


class Evaluation:
    """Evaluation beyond eval_step and compute_metrics: metric names known early, a tie-break, hooks around an
    evaluation, plots after it (every built-in recipe)."""

    tie_break_metric: ClassVar[tuple[str, str] | None] = None     # decides between equal primary values

    def metric_names(self) -> Collection[str] | None:
        """The names of the validation metrics, known before any evaluation (built data, no model run): a
        train.select_metric outside them is refused before the run writes anything. None: not known before the first
        validation (the setting is checked then)."""
        return None

    def on_evaluation_start(self, model: torch.nn.Module) -> None:
        """Every rank, before the batches of an evaluation (e.g. cache embeddings shared by all batches)."""

    def on_evaluation_end(self) -> None:
        """Every rank, after an evaluation (release what on_evaluation_start cached)."""

    def after_evaluation(self, split: str, metrics: dict[str, Any], run_dir: str, epoch: int) -> Sequence[Any]:
        """Rank 0 only: write plots or tables for the metrics of a split; returns the PNG files written (the
        engine also shows them in TensorBoard)."""
        return ()


class Prediction:
    """`trainer predict` (every built-in recipe), and the id maps of compacted sparse ids (kgat)."""

    predict_unit_name: ClassVar[str] = "items"   # what predict_units lists, for the log ("users", "videos", ...)

    def predict_units(self, request: Any) -> Sequence[Any]:
        """`trainer predict`: what to predict for (users, videos, ...), the same list on every rank (the command
        cuts it into parts). request: engine/predict.PredictRequest."""
        from trainer.engine.predict_parts import PredictError
        raise PredictError(f"{type(self).__name__}: predict is not available for this recipe yet")

    def predict_rows(self, model: torch.nn.Module, units: Sequence[Any], request: Any) -> dict[str, Any]:
        """The output columns (equal-length arrays) for a slice of predict_units, the model in eval mode."""
        raise NotImplementedError

    def id_maps(self) -> dict[str, Any]:
        """The original id of each id, per kind, where the recipe compacted sparse ids (data.remap_ids): saved
        in RUN_DIR/ids.npz and every checkpoint, and checked against the data on resume and eval."""
        return {}


class MemoryEstimate:
    """The memory check before the model is built (trainer/engine/footprint.py) and the allocator's policy (kgat,
    sasrec)."""

    reuse_freed_memory: ClassVar[bool] = True        # steps free and remake large tensors: trainer/native/memory.py

    def model_for_estimate(self) -> torch.nn.Module:
        """The model with its shapes and no storage (the meta device), for the memory estimate made before the
        model is built (trainer/engine/footprint.py); a recipe whose build_model reads tensor values overrides it."""
        with torch.device("meta"):
            return self.build_model()           # type: ignore[attr-defined]  (the Recipe's core)

    def optimizer_states(self) -> int:
        """How many copies of the weights the optimizer keeps (Adam/AdamW: 2; SGD: its momentum, if any)."""
        oc = self.optim_cfg                     # type: ignore[attr-defined]
        return 2 if oc.name in ("adam", "adamw") else int(bool(getattr(oc, "momentum", 0)))

    def memory_drivers(self) -> str:
        """The settings and data sizes that set the model's size, for the message of a model that cannot fit."""
        return "the model.* settings"


class DDPPolicy:
    """How the model is wrapped for DDP and its buffers kept alike (kgat averages after the backward; har and video
    send buffers before evaluating)."""

    find_unused_parameters: ClassVar[bool] = False   # DDP: some steps leave parameters without gradients
    # instead of DDP: every gradient averaged in one all-reduce after the backward (no buckets, no per-bucket
    # synchronisation, no search for unused parameters); for models whose steps use different parameters
    average_after_backward: ClassVar[bool] = False
    broadcast_buffers: ClassVar[bool] = True         # DDP: rank 0's buffers to every rank before each forward
    buffers_before_eval: ClassVar[bool] = False      # instead: rank 0's buffers to every rank before evaluating


class GPUShapedStep:
    """The GPU-shaped step (train.gpu_path) and host work around a traced or captured step (kgat, har, video)."""

    @property
    def gpu_shaped(self) -> bool:
        """Whether this run takes the GPU-shaped step (train.gpu_path; auto: on a CUDA device): fixed shapes and
        no host read inside a step, where a recipe's CPU path packs, buckets or loops on data-dependent sizes."""
        mode = getattr(self.train_cfg, "gpu_path", "auto")            # type: ignore[attr-defined]
        return mode == "on" or (mode == "auto" and str(getattr(self.dist, "device", "cpu")).startswith("cuda"))  # type: ignore[attr-defined]

    def before_step(self, batch: Any) -> None:
        """Host-side work of a micro-batch before its training_step (which compile.mode traces: a clock read
        or an optimizer's phase switch there would break its graph)."""

    def after_step(self) -> None:
        """After training_step returned, outside compile.mode's graph: a CUDA-graph replay's outputs that the
        recipe keeps are read here, before the next replay writes over them."""


class OwnOptimizer:
    """An optimizer of the recipe's own instead of optim.name's (kgat: sparse rows, a phase per epoch part)."""

    def build_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer | None:
        """A recipe-specific optimizer at the (world-size scaled) lr; None: the engine's optim.name."""
        return None


class DataProvenance:
    """What the checkpoint records of the data (its fingerprint; every built-in recipe counts its data)."""

    def data_files(self) -> list:
        """The files this run's data was read from (its fingerprint, in every checkpoint): by default those of
        data.path (trainer/data/fingerprint.py files_under); none for generated data."""
        from trainer.data.fingerprint import files_under
        path = getattr(self.data_cfg, "path", "")                     # type: ignore[attr-defined]
        return files_under(path) if path else []

    def data_counts(self) -> dict[str, int]:
        """The data's sizes that the checkpoint records beside its files (users, items, interactions, classes)."""
        return {}


CAPABILITIES: tuple[type, ...] = (Batching, DeviceResident, EpochPlan, Evaluation, Prediction, MemoryEstimate,
                                  DDPPolicy, GPUShapedStep, OwnOptimizer, DataProvenance)


@functools.cache
def members(capability: type) -> tuple[str, ...]:
    """A capability's own members, in the order they are declared (once per capability: a view asks on every read)."""
    return tuple(name for name in vars(capability) if not name.startswith("_"))


def of(recipe: Any, capability: type[T]) -> T:
    """The recipe seen as `capability` (see the module's docstring)."""
    return recipe if isinstance(recipe, capability) else _View(recipe, capability)  # type: ignore[return-value]


class _View:
    """A recipe that does not inherit a capability, read as one: its own member where it has one, else the
    capability's default bound to the recipe."""

    __slots__ = ("_recipe", "_capability")

    def __init__(self, recipe: Any, capability: type):
        self._recipe, self._capability = recipe, capability

    def __getattr__(self, name: str) -> Any:
        recipe, capability = self._recipe, self._capability
        if name not in members(capability):
            raise AttributeError(f"{capability.__name__} has no member {name!r}")
        if hasattr(recipe, name):             # the Recipe core defines none of them: the recipe's own
            return getattr(recipe, name)
        default = inspect.getattr_static(capability, name)
        return default.__get__(recipe, type(recipe)) if hasattr(default, "__get__") else default

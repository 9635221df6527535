"""The memory a run's model will take, estimated before it is taken: the recipe's model built on the meta device
(shapes, no storage), then the bytes of its weights, their gradients, the optimizer's state and DDP's gradient
buckets on each rank, against the device's free memory (a GPU's) or the host's (MemAvailable, or the cgroup's
limit where Slurm sets one, shared by the host's ranks).

    fp = check_before_build(recipe, info)     # logs the Footprint; MemoryShortError (exit 4) where it cannot fit

Activations and the data come on top and are not counted: the check stops only what cannot fit at all.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from trainer.engine.capabilities import MemoryEstimate, of
from trainer.launch.exitcodes import ResourceError
from trainer.native.memory import free_memory

log = logging.getLogger(__name__)

class MemoryShortError(ResourceError):
    """The model, its gradients and its optimizer state do not fit the free memory: a relaunch fails the same."""


@dataclass(frozen=True)
class Footprint:
    params: int                 # trainable parameters
    weights: int                # bytes: parameters and buffers
    grads: int
    optimizer: int
    buckets: int                # DDP's gradient buckets (a copy of the gradients) where the world is > 1
    largest: str                # the largest tensor: name [shape]

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.buckets

    def describe(self) -> str:
        parts = [f"weights {size(self.weights)}", f"gradients {size(self.grads)}",
                 f"optimizer state {size(self.optimizer)}"]
        if self.buckets:
            parts.append(f"DDP buckets {size(self.buckets)}")
        return f"model: {self.params:,} parameters; per rank {size(self.total)} ({', '.join(parts)}; largest " \
               f"{self.largest}; activations come on top)"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def estimate(recipe, info) -> Footprint:
    """The footprint of the recipe's model_for_estimate() (built on the meta device: nothing allocated)."""
    memory = of(recipe, MemoryEstimate)
    model = memory.model_for_estimate()
    params = [(name, p) for name, p in model.named_parameters()]
    trainable = [p for _, p in params if p.requires_grad]
    weights = sum(t.numel() * t.element_size() for _, t in [*params, *model.named_buffers()])
    grads = sum(p.numel() * p.element_size() for p in trainable)
    states = memory.optimizer_states()
    name, biggest = max(params, key=lambda np_: np_[1].numel(), default=("none", torch.empty(0)))
    return Footprint(params=sum(p.numel() for p in trainable), weights=weights, grads=grads,
                     optimizer=states * grads, buckets=grads if info.distributed else 0,
                     largest=f"{name} {list(biggest.shape)}")


def check_fits(fp: Footprint, info, drivers: str) -> None:
    """MemoryShortError naming both figures and the settings that drive them when the estimate cannot fit."""
    free, where, sharing = free_memory(info)
    need = fp.total * sharing
    if need <= free:
        return
    ranks = f" x {sharing} ranks on this host" if sharing > 1 else ""
    raise MemoryShortError(
        f"the model needs {size(need)} for weights, gradients and optimizer state ({size(fp.total)} per rank"
        f"{ranks}: {fp.params:,} parameters, largest {fp.largest}), and {size(free)} is {where}.\n"
        f"HINT: {drivers} set its size; make them smaller, or run where more memory is free")


def check_before_build(recipe, info) -> Footprint | None:
    """Estimate, log (rank 0) and check; every rank stops when one rank's memory is short (the ranks agree, so
    none waits in a collective for a rank that stopped)."""
    from trainer.distributed import runtime
    try:
        fp = estimate(recipe, info)
    except Exception as err:  # noqa: BLE001 - a plugin's build_model that reads tensor values cannot run on meta
        log.warning("no memory estimate: %s's model does not build on the meta device (%s: %s); override "
                    "MemoryEstimate.model_for_estimate", type(recipe).__name__, type(err).__name__, str(err)[:200])
        return None
    if info.is_main:
        log.info(fp.describe())
    try:
        check_fits(fp, info, of(recipe, MemoryEstimate).memory_drivers())
        short = None
    except MemoryShortError as err:
        short = f"rank {info.rank}: {err}" if info.distributed else str(err)
    shorts = [s for s in runtime.all_gather_object(short, info) if s]
    if shorts:
        raise MemoryShortError(shorts[0])
    return fp

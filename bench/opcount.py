"""What a training step asks of the device, counted on any device (the CPU included): ATen ops (on a GPU each
is a kernel launch, or a view) and host syncs (ops whose result the host must wait for: a GPU stops being fed
while it does). Times on a shared CPU are noise; these counts are not.

    with OpCount() as count:
        epoch_loop.step(batch, micro)
    count.ops, count.syncs, count.sync_names      # totals, and which ops synced

    counts = step_counts("sasrec", ["model.time=false", "model.mhc=false", "train.gpu_path=on"])

A sync is one of SYNC_OPS, an index with a boolean mask (a nonzero inside), or a host read of a tensor
(tolist, numpy, cpu: on the CUDA path every tensor of a step lives on the GPU, so each is a device-to-host
copy that waits for the GPU).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "_local_scalar_dense",                      # .item(), float(t), int(t), bool(t)
    "is_nonzero", "equal",                      # bool(t), torch.equal
    "nonzero", "nonzero_numpy", "argwhere", "masked_select",
    "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "repeat_interleave",                        # with tensor repeats: the output size is data-dependent
    "bincount", "histc",                        # the output size (or range) is read from the data
    "_assert_async",
})
INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
HOST_READS = ("tolist", "numpy", "cpu")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (forward, backward and optimizer alike: autograd's backward
    runs in this thread on a CPU) and the host syncs among them, plus host reads of tensors."""

    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()
        self.sync_names: collections.Counter = collections.Counter()
        self._patched: dict[str, Any] = {}

    @property
    def ops(self) -> int:
        return sum(self.names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_names.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names[name] += 1
        if name in SYNC_OPS or (name in INDEXING and _bool_index(args)):
            self.sync_names[name] += 1
        return func(*args, **(kwargs or {}))

    def _host_read(self, name: str, original):
        def read(tensor, *args, **kwargs):
            self.sync_names[f"Tensor.{name}"] += 1
            return original(tensor, *args, **kwargs)
        return read

    def __enter__(self):
        for name in HOST_READS:
            self._patched[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._host_read(name, self._patched[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._patched.items():
                setattr(torch.Tensor, name, original)
            self._patched.clear()


@dataclass
class StepCounts:
    """Per optimizer step (the median over the counted steps): the step's ATen ops, the ops that made its
    batches (a DataLoader's collation on the host, or a gather from a dataset held on the device), and the host
    syncs of both, with their names."""

    ops: int
    data_ops: int
    syncs: int
    sync_names: dict[str, int] = field(default_factory=dict)
    steps: int = 0


def epoch_loop_for(recipe: str, overrides: list[str], device: str = "cpu"):
    """A single-process EpochLoop of a recipe, built as `python -m trainer train` builds it (its run, state, meter and
    losses; no components and no run directory: nothing is written); returns (the loop, an iterator over its first
    epoch's batches). Its losses are read by epoch_loop.losses.read()."""
    from trainer.config.registry import get_spec
    from trainer.config.settings import build_config
    from trainer.distributed.runtime import DistInfo
    from trainer.engine.build import build_run
    from trainer.engine.loop import EpochLoop
    from trainer.engine.meters import Throughput
    from trainer.engine.session import build_recipe
    from trainer.engine.state import TrainState
    from trainer.engine.window import TrainLosses
    cfg = build_config(recipe, None, {}, ["log.tensorboard=false", "log.progress=off", *overrides])
    info = DistInfo(device=device)
    run = build_run(build_recipe(cfg, info, get_spec(cfg.recipe)), info, cfg)
    state = TrainState()
    losses = TrainLosses(run.device, info, max(cfg.log.every_steps, 1) * run.accum, state)
    epoch_loop = EpochLoop(run, state, Throughput(run.device), losses)
    run.recipe.on_epoch_start(0, run.model)
    run.wrapped.train()
    return epoch_loop, iter(epoch_loop.batches(0, 0))


def endless(tr):
    """(batch, micro) over epoch after epoch of an EpochLoop's own batches (a small dataset's epoch may hold
    fewer batches than a measurement needs)."""
    epoch = 0
    while True:
        tr.run.recipe.on_epoch_start(epoch, tr.run.model)
        for micro, batch in enumerate(tr.batches(epoch, 0)):
            yield batch, micro
        epoch += 1


def step_counts(recipe: str, overrides: list[str], warmup: int = 2, steps: int = 2, device: str = "cpu") -> StepCounts:
    """Ops and syncs of one optimizer step of `recipe` under `overrides` (after `warmup` steps: lazy state
    such as the optimizer's is made then), the median of `steps` counted steps."""
    epoch_loop, batches = epoch_loop_for(recipe, overrides, device)
    micro, counted = 0, []

    def one_step(data: OpCount | None, step: OpCount | None) -> None:
        nonlocal micro
        while True:
            with data or contextlib.nullcontext():
                batch = next(batches)
            micro += 1
            with step or contextlib.nullcontext():
                if epoch_loop.step(batch, micro - 1):
                    return
    for _ in range(warmup):
        one_step(None, None)
    for _ in range(steps):
        data, step = OpCount(), OpCount()
        one_step(data, step)
        counted.append((step, data))
    step, data = sorted(counted, key=lambda c: c[0].ops)[len(counted) // 2]
    names = collections.Counter(step.sync_names) + collections.Counter(data.sync_names)
    return StepCounts(step.ops, data.ops, step.syncs + data.syncs, dict(names), len(counted))

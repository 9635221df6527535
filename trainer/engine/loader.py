"""Samplers and loaders: deterministic per epoch, shardable across ranks, resumable mid-epoch."""
from __future__ import annotations

import functools
import math
import multiprocessing
import os
import select
import signal
import threading
import time
from multiprocessing import forkserver
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableSampler(Sampler[int]):
    """DistributedSampler semantics (shuffle by seed+epoch, pad to a multiple of the world, stride by
    rank) plus a start position, so a resumed run continues from the next unseen sample.

    The position is global: `start` samples of the epoch's permutation (which depends on the seed and the epoch
    only, never on the world size or the batch size) are done. The rest, padded with the permutation's first
    samples to a multiple of the world (at most world - 1 repeats), is strided over the ranks. So a run that
    comes back with another world size or batch size trains every remaining sample exactly once, and one that
    comes back unchanged continues exactly where it stopped.

    With `costs` (a per-sample work estimate, e.g. a sequence length) and `batch_size`, each global batch
    (the world's batch_size x world consecutive samples of the permutation, the same set the plain striding
    gives) is dealt to the ranks in order of cost, so every rank gets a like share of long and short samples:
    DDP steps at the pace of the slowest rank, and a rank drawing the longer sequences kept the other waiting.
    The global batches, and so the averaged gradient, are the same sets as without costs."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0,
                 costs: Sequence[float] | None = None, batch_size: int = 0):
        if size <= 0:
            raise ValueError("cannot sample from an empty dataset")
        if costs is not None and len(costs) != size:
            raise ValueError(f"{len(costs)} sample costs for a dataset of {size} samples")
        self.size, self.rank, self.world, self.shuffle, self.seed = size, rank, world_size, shuffle, seed
        self.costs, self.batch_size = costs, batch_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation; its first `start` samples (over all ranks) are done."""
        if not 0 <= start <= self.size:
            raise ValueError(f"sample position {start} outside an epoch of {self.size} samples")
        self.epoch, self.start = epoch, start

    @property
    def per_rank(self) -> int:
        """This rank's samples from the start position to the epoch's end (every rank has as many)."""
        return math.ceil((self.size - self.start) / self.world)

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.size, generator=g).tolist()
        else:
            perm = list(range(self.size))
        order, total = perm[self.start:], self.per_rank * self.world
        order += (perm * math.ceil(total / self.size))[: total - len(order)]
        if self.costs is None or self.world == 1 or self.batch_size <= 0:
            return order[self.rank:total:self.world]
        window, mine = self.batch_size * self.world, []
        # snake order (ranks 0, 1, 1, 0, 0, 1, ... down the costs): no rank always takes the larger of a round,
        # so this rank's places repeat every two rounds: rank and 2 x world - 1 - rank
        places = (self.rank, 2 * self.world - 1 - self.rank)
        for lo in range(0, total, window):      # stable sort: equal costs keep the permutation's order
            ranked = sorted(order[lo:lo + window], key=lambda i: -self.costs[i])
            mine += [i for p, i in enumerate(ranked) if p % (2 * self.world) in places]
        return mine

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return self.per_rank


class TensorBatches:
    """A training set of tensors (first dimension: samples) held on the device: a batch is one gather per
    tensor (Recipe.device_dataset)."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device):
        self.tensors = tuple(t.to(device) for t in tensors)

    def __len__(self) -> int:
        return len(self.tensors[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def gather(self, index: torch.Tensor, epoch: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)


def fits_on_device(nbytes: int, device: torch.device, share: float = 0.25) -> bool:
    """Whether a training set of nbytes may live on the device: at most `share` of a GPU's free memory (the
    rest is the model's); always on a CPU, where it lives already."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


def device_batches(data, order: Sequence[int], batch_size: int, epoch: int, device: torch.device):
    """The batches of `order` (this rank's sample indices, in order) gathered from a device-held training set:
    the indices go to the device once, every batch is a gather there. The last batch of an epoch may be shorter
    (its own shape: compiled, or captured, once more)."""
    index = torch.tensor(list(order), dtype=torch.int64).to(device, non_blocking=True)
    return (data.gather(index[i:i + batch_size], epoch) for i in range(0, len(index), batch_size))


class ShardSampler(Sampler[int]):
    """Evaluation shard of a rank: every sample exactly once across ranks (no padding)."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def ignore_preemption_signals(worker_id: int, owner: int | None = None) -> None:
    """DataLoader worker_init_fn (with owner=the training process's pid). Slurm (scancel --signal, preemption,
    the time-limit warning) signals every process of a task, loader workers included; torch's worker handler
    dies on a SIGTERM not sent by its parent, and USR1/USR2 end a process by default, after which the training
    process raises "DataLoader worker is killed by signal" instead of checkpointing. The training process
    decides; workers go on, and exit with it (exit_with)."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if owner is not None:
        exit_with(owner)


def exit_with(pid: int) -> None:
    """End this worker when process `pid` ends. torch's worker watchdog follows the worker's parent, which is the
    fork server here: a training process killed outright (SIGKILL, the OOM killer) left its workers and the fork
    server (which waits for them) running for good, holding the launcher's pipes (torchrun restarts, seen)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):        # no pidfd (Linux < 5.3): look once a second
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])          # readable once the process has exited
        else:
            while os.path.exists(f"/proc/{pid}"):
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-trainer", daemon=True).start()


# imported once in the fork server, so a worker starts with torch and the recipes' data modules in memory
WORKER_PRELOAD = ["torch", "numpy", "trainer.cli.parser", "trainer.engine.loader"]


def worker_context() -> multiprocessing.context.BaseContext:
    """Loader workers forked from a single-threaded fork server, not from the training process.

    A worker forked from a rank inherits copies of locks that the rank's other threads (gloo's, the
    pin-memory thread, the intra-op pool) may hold at that instant, and can block on one forever: seen in
    2-rank CI runs as a rank waiting in its first evaluation batch for a worker that never delivered
    (pytorch #130610). The server and its resource tracker are started with the preemption signals ignored
    (a disposition that survives exec), so Slurm's signals to every process of the task leave them, and the
    workers they fork, running; the signals are blocked meanwhile, so the rank itself loses none."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return ctx
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in PREEMPTION_SIGNALS}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ctx


def make_loader(dataset: Dataset, sampler: Sampler, batch_size: int, num_workers: int, collate_fn,
                seed: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader with its own generator, so creating it never consumes the global RNG; its workers
    come from the fork server (worker_context)."""
    init = functools.partial(ignore_preemption_signals, owner=os.getpid())
    workers = {"multiprocessing_context": worker_context(), "worker_init_fn": init} if num_workers > 0 else {}
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_fn, pin_memory=pin_memory, drop_last=False,
                      generator=torch.Generator().manual_seed(seed), persistent_workers=False, **workers)


def per_rank_batch_size(train_cfg, world_size: int, replicas: int = 1) -> int:
    """Per-rank (per-process) micro-batch size: --batch-size per GPU x the GPUs DataParallel spreads the
    process's batch over (replicas), or --global-batch-size / (world x accumulation)."""
    accum = max(train_cfg.grad_accum_steps, 1)
    if train_cfg.global_batch_size > 0:
        div = world_size * accum
        if train_cfg.global_batch_size % div:
            raise ValueError(f"global batch size {train_cfg.global_batch_size} is not divisible by "
                             f"world size {world_size} x grad_accum_steps {accum} = {div}.\n"
                             f"HINT: pick a multiple of {div}, or give --batch-size per GPU instead.")
        return train_cfg.global_batch_size // div
    if train_cfg.batch_size <= 0:
        raise ValueError(f"batch size must be positive, got {train_cfg.batch_size}")
    return train_cfg.batch_size * replicas

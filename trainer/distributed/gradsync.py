"""DDP's gradient all-reduce as a comm hook: through shared memory where the ranks have it
(`dist.shm_allreduce`, trainer/distributed/shm.py), else gloo/NCCL as DDP's default; and how long each optimizer
step waits for it (`log.measure_sync=true`; the loop adds the time of its own per-step collective, the
preemption-signal agreement).

A DDP comm hook all-reduces each bucket as DDP's default does, and notes when the bucket was ready and when
its all-reduce finished; a step's wait is the last finish minus the last ready time, which is when this
rank's backward had nothing left to compute. It covers the all-reduce itself and the wait for the slowest
rank. A model outside DDP (Recipe.average_after_backward: KGAT) has its gradients averaged by `after_backward`
in one all-reduce once the backward is done, timed whole as waiting. A recipe's own blocking collective inside
the backward is timed with `timer.timed()`; the buckets' wait then counts only from the end of the last such
collective, since until then this rank was busy (computing the rest of its backward, or in that collective).
On CUDA the times are the host's view of NCCL's work, so the figure is meant for CPU/gloo.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from trainer.distributed import runtime


class GradSyncTimer:
    """DDP comm hook state: the ready and finish times of the current step's buckets."""

    def __init__(self, comm=None, group=None):
        self.comm, self.group = comm, group          # comm: a ShmComm, or None for the process group
        self.world = dist.get_world_size(group)
        self.ready, self.finished = 0.0, 0.0
        self.own, self.own_end = 0.0, 0.0           # the recipe's blocking collectives: their time, the last end

    @contextlib.contextmanager
    def timed(self):
        """Time a blocking collective that the recipe runs inside the backward."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.own_end = time.perf_counter()
            self.own += self.own_end - t0

    def take(self) -> float:
        """Seconds this step waited for its gradients; resets for the next step."""
        wait = self.own + max(self.finished - max(self.ready, self.own_end), 0.0)
        self.ready = self.finished = self.own = self.own_end = 0.0
        return wait


# no `from __future__ import annotations` here: DDP checks the hook's annotations as objects
def allreduce_hook(state: GradSyncTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce: the mean of the ranks' gradients (sum, then divide by the world size)."""
    buffer = bucket.buffer()
    if state.comm is not None and state.comm.all_reduce_(buffer, "sum", 1.0 / state.world):
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    fut = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(state.world))


def timed_allreduce_hook(timer: GradSyncTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """allreduce_hook, timed. The shared-memory all-reduce runs inside the hook, blocking: all of its time is
    waiting (as a recipe's own collective is); gloo/NCCL's runs beside the backward, and only its end counts."""
    t0 = time.perf_counter()
    fut = allreduce_hook(timer, bucket)
    if fut.done():
        timer.own_end = time.perf_counter()
        timer.own += timer.own_end - t0
        return fut
    timer.ready = max(timer.ready, t0)

    def finish(f: torch.futures.Future) -> torch.Tensor:
        timer.finished = max(timer.finished, time.perf_counter())
        return f.value()

    return fut.then(finish)


def attach(ddp: torch.nn.parallel.DistributedDataParallel, comm=None, timed: bool = True) -> GradSyncTimer:
    """Register the all-reduce (timed or not) on a DDP module; returns its state (the timer)."""
    timer = GradSyncTimer(comm)
    ddp.register_comm_hook(timer, timed_allreduce_hook if timed else allreduce_hook)
    return timer


def after_backward(params: list[torch.nn.Parameter], info, timer: GradSyncTimer | None):
    """The step's gradient averaging for a model outside DDP (Recipe.average_after_backward): call it after the
    last micro-batch's backward. Its whole time counts as waiting (it starts when this rank's backward ends)."""
    def sync() -> None:
        with timer.timed() if timer is not None else contextlib.nullcontext():
            runtime.average_grads(params, info)

    return sync

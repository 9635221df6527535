"""The device clock (trainer/engine/device_clock.py) with the host's clock standing in for CUDA events: a step is
timed from its first micro-batch to its last gradient, not to the end of a wait after it; one event a step, on the
parameter learnt to be ready last; and under real DDP (two gloo ranks, rank 1's backward slowed) the fast rank's
step, whose backward() returns only when the slow rank's gradients have arrived (as NCCL's compute stream waits),
is timed without that wait. What CUDA itself adds (events on the compute stream, NCCL's stream) needs a GPU: the
GPU issue's device script runs it."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.timeouts import limit
from trainer.engine.device_clock import DeviceClock, HostEvent


class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps (work on this rank's device, in the stand-in)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Net(torch.nn.Module):
    def __init__(self, slow_s: float = 0.0, spare: bool = False):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.spare = torch.nn.Linear(8, 1) if spare else None
        self.slow_s, self.use_spare = slow_s, False

    def forward(self, x):
        # the slow backward sits between the two layers: the first layer's gradients come after it
        h = SlowBackward.apply(torch.relu(self.first(x)), self.slow_s)
        out = self.second(h)
        return out + self.spare(x) if self.use_spare else out


def one_step(model, clock, micro: int = 1, wait_after_s: float = 0.0):
    for _ in range(micro):
        clock.step_start()
        model(torch.ones(4, 8)).sum().backward()
    time.sleep(wait_after_s)                 # what a fast rank waits for the others after its last gradient
    clock.step_end()


@pytest.mark.timing
def test_a_step_is_timed_to_its_last_gradient_not_to_a_wait_after_it():
    model = Net(slow_s=0.05)
    clock = DeviceClock(model.parameters(), HostEvent)
    one_step(model, clock)                   # learns which gradient is ready last: not timed
    assert clock.take() == (0.0, 0)
    assert clock.last_param == id(model.first.bias) or clock.last_param == id(model.first.weight)
    for _ in range(2):
        one_step(model, clock, wait_after_s=0.2)
    seconds, steps = clock.take()
    assert steps == 2 and 2 * 0.05 <= seconds < 2 * 0.05 + 0.15, seconds     # the backward's 50 ms, not the 200
    one_step(model, clock, micro=3)          # accumulation: from the first micro-batch to the last's gradient
    seconds, steps = clock.take()
    assert steps == 1 and seconds >= 3 * 0.05


def test_one_event_a_step_and_the_order_learnt_again_when_the_last_parameter_has_no_gradient():
    model = Net(spare=True)
    recorded = []

    class Counted(HostEvent):
        def record(self):
            recorded.append(1)
            super().record()

    clock = DeviceClock(model.parameters(), Counted)
    one_step(model, clock)
    recorded.clear()
    one_step(model, clock)
    assert len(recorded) == 2                # the step's start and its last gradient, not one per parameter
    assert clock.take()[1] == 1
    model.use_spare = True                   # a parameter used from now on: the last one may change
    learnt = clock.last_param
    one_step(model, clock)
    assert clock.take()[1] == 1 and clock.last_param == learnt   # the learnt one still had its gradient
    model.first.weight.requires_grad_(False)
    model.first.bias.requires_grad_(False)
    one_step(model, clock)                   # the learnt parameter had none: not timed, learnt again
    one_step(model, clock)
    one_step(model, clock)
    assert clock.last_param != learnt and clock.take()[1] == 1


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net(slow_s=0.15 if rank == 1 else 0.0))
    clock = DeviceClock(model.parameters(), HostEvent)
    host = 0.0
    for step in range(4):
        t0 = time.perf_counter()
        one_step(model, clock)
        host += time.perf_counter() - t0 if step else 0.0
    out.put((rank, clock.take()[0] / 3, host / 3))
    dist.destroy_process_group()


@pytest.mark.timing
def test_under_ddp_the_fast_rank_is_timed_without_its_wait_for_the_slow_one():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    figures = dict((r, (own, host)) for r, own, host in (out.get(timeout=limit("run")) for _ in procs))
    for p in procs:
        p.join(30)
    (own0, host0), (own1, host1) = figures[0], figures[1]
    assert host0 >= 0.15 and host1 >= 0.15   # the host clock: both ranks' steps take the slow one's time
    assert own1 >= 0.15 and own0 < 0.05, figures     # the device clock: the slow rank stands out

"""Issue 69 point 1 on a GPU (marked gpu; bench/gpu_check.sh step 6): the straggler watch's device clock in a
stand-in for NCCL. Two ranks share the one GPU; rank 1's device work is slower for real (`torch.cuda._sleep` in its
backward); after its backward rank 1 records an interprocess CUDA event and rank 0's compute stream waits for it
(`wait_event`) while rank 0's host waits for nothing but rank 1's host (a gloo barrier, passed as soon as rank 1 has
queued its step): as under NCCL, the fast rank's stream, not its host, waits for the slow rank. Each window (one
sync) both clocks are read: the device clock (trainer/engine/device_clock.py) must name rank 1 through the straggler
watch's rule, and the window's CUDA time (the clock before it) must not, since both ranks' windows include the wait.

Where torch sees no CUDA device it is skipped with the reason printed, unless GPU_CHECK_ON_CPU=1: then the host
clock stands in for the events, a sleep for the device work and the barrier for the stream's wait (a plumbing
check of the harness, not of CUDA)."""
from __future__ import annotations

import os
import time
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port
from tests.gpu.test_cuda_resume import ON_CPU, pytestmark  # noqa: F401 - the gpu mark and its skip
from tests.timeouts import limit
from trainer.distributed.stragglers import FACTOR, WINDOWS, StragglerWatch
from trainer.engine.device_clock import DeviceClock, HostEvent, cuda_event

SLOW_S = 0.03          # rank 1's extra device work per step
STEPS, WINDOW = 60, 10  # steps, and steps per window: 6 windows


class DeviceWork(torch.autograd.Function):
    """Identity forward; in the backward, `seconds` of device work (a spinning kernel; on the CPU a sleep)."""

    cycles_per_s = 1.0e9                # measured per process (cycles_per_s())

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds:
            if grad.is_cuda:
                torch.cuda._sleep(int(ctx.seconds * DeviceWork.cycles_per_s))
            else:
                time.sleep(ctx.seconds)
        return grad, None


def cycles_per_s() -> float:
    """The spinning kernel's cycles per second on this GPU, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1000.0)


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        DeviceWork.cycles_per_s = cycles_per_s()
    torch.manual_seed(0)
    first, second = torch.nn.Linear(256, 256).to(device), torch.nn.Linear(256, 1).to(device)
    params = list(first.parameters()) + list(second.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    clock = DeviceClock(params, cuda_event if cuda else HostEvent)
    if cuda:     # rank 1's event, shared with rank 0 (interprocess events cannot time)
        mine = torch.cuda.Event(enable_timing=False, interprocess=True) if rank == 1 else None
        handles = [mine.ipc_handle() if rank == 1 else None]
        dist.broadcast_object_list(handles, src=1)
        peer = torch.cuda.Event.from_ipc_handle(device, handles[0]) if rank == 0 else None
    x = torch.randn(64, 256, device=device)
    watch_device, watch_window = StragglerWatch(["nodeA", "nodeB"]), StragglerWatch(["nodeA", "nodeB"])
    named_device, named_window, factors = None, None, []
    window_start = _event(cuda)
    for step in range(1, STEPS + 1):
        clock.step_start()
        h = DeviceWork.apply(torch.relu(first(x)), SLOW_S if rank == 1 else 0.0)
        second(h).pow(2).mean().backward()
        if cuda:
            if rank == 1:
                mine.record()                          # rank 1's gradients are ready here
            dist.barrier()                             # rank 1 has queued its record (its host, not its device)
            if rank == 0:
                torch.cuda.current_stream().wait_event(peer)   # as NCCL: the stream waits, the host does not
        else:
            dist.barrier()                             # the stand-in's stand-in: the host waits
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_end()
        if step % WINDOW == 0:
            end = _event(cuda)
            if cuda:
                end.synchronize()                      # the window's one sync (elapsed_time needs both complete)
            window_s = _elapsed(window_start, end)
            window_start = _event(cuda)
            seconds, timed = clock.take()
            own = [0.0, 0.0]
            own[rank] = seconds / timed if timed else 0.0
            wall = [0.0, 0.0]
            wall[rank] = window_s / WINDOW
            gathered = [None, None]
            dist.all_gather_object(gathered, (own[rank], wall[rank]))
            device_own, window_own = [g[0] for g in gathered], [g[1] for g in gathered]
            factors.append((device_own, window_own))
            _, named = watch_device.observe(device_own)
            named_device = named_device or named
            _, named = watch_window.observe(window_own)
            named_window = named_window or named
    if rank == 0:
        queue.put((named_device, named_window, factors))
    dist.destroy_process_group()


def _event(cuda: bool):
    event = torch.cuda.Event(enable_timing=True) if cuda else HostEvent()
    event.record()
    return event


def _elapsed(start, end) -> float:
    return start.elapsed_time(end) / 1000.0


def test_the_device_clock_names_the_rank_the_window_clock_cannot_see_when_the_stream_waits():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit("start")
    while True:              # a rank that dies fails the test at once, not at the deadline
        try:
            named_device, named_window, factors = queue.get(timeout=2)
            break
        except Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            assert not dead, f"ranks exited early (rank: exit code): {dead}"
            assert time.monotonic() < deadline, "no result from rank 0 in 240 s"
    for p in procs:
        p.join(60)
    print("per window: (device clock own s/step per rank, window clock s/step per rank):", factors)
    assert named_device is not None and named_device.rank == 1 and named_device.factor >= FACTOR, factors
    assert named_window is None, factors       # the clock before it: both ranks' windows hold the wait
    assert len(factors) > WINDOWS
    if not ON_CPU:
        assert all(abs(w[1] / w[0] - 1) < 0.5 for _, w in factors[1:]), factors

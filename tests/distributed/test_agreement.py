"""The agreements of a training step, on two real gloo ranks: the preemption signal at every step over a host
collective, and the losses kept on the device read in one all-reduce that names the first non-finite one."""
import signal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine.preemption import PreemptionHandler
from trainer.engine.window import LossWindow, Place

SIGNALS = [(signal.SIGUSR1, signal.SIGUSR2), (0, 0), (0, signal.SIGTERM)]       # per case: rank 0's, rank 1's
LOSSES = [([1.5, 2.0], [2.5, 3.0]), ([0.25, 1.0], [0.5, float("nan")]), ([], [])]  # per case: each rank's window


def _rank(rank: int, store: str, out: str, host_group: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, backend="gloo", local_world_size=2)
    if host_group:            # as runtime.init makes it where the default group is NCCL's
        runtime._local["host_group"] = runtime.host_group(60)
    got = []
    for signals, losses in zip(SIGNALS, LOSSES):
        handler = PreemptionHandler([])
        handler.received = int(signals[rank])
        window = LossWindow(torch.device("cpu"), info, capacity=4)
        for i, loss in enumerate(losses[rank]):
            window.add(torch.tensor(loss), samples=2 + rank, step=10 + i, epoch=1, batch=3 + i)
        got.append((handler.agreed_signal(info), window.read()))
    runtime._local["host_group"] = None
    torch.save([(s, r.loss_sum, r.samples, r.bad and r.bad.step) for s, r in got], f"{out}.{rank}")
    dist.destroy_process_group()


def _run(tmp_path, host_group: bool):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "got"), host_group), nprocs=2)
    return [torch.load(tmp_path / f"got.{r}", weights_only=True) for r in (0, 1)]


def test_signals_and_loss_windows_agree_on_both_ranks(tmp_path):
    got = _run(tmp_path, host_group=False)
    first, second, third = got[0]
    assert first == (int(signal.SIGUSR2), 1.5 * 2 + 2.0 * 2 + 2.5 * 3 + 3.0 * 3, 10.0, None)   # the highest signal
    assert second[0] == 0 and second[1] != second[1] and second[3] == 11     # rank 1's NaN: step 11 on both ranks
    assert third == (int(signal.SIGTERM), 0.0, 0.0, None)
    assert str(got[0]) == str(got[1])                                 # the same on every rank (NaN too)


def test_the_host_group_agrees_like_the_default_group(tmp_path):
    (tmp_path / "host").mkdir()
    assert str(_run(tmp_path / "host", host_group=True)) == str(_run(tmp_path, host_group=False))


def test_a_single_process_agrees_with_itself():
    handler = PreemptionHandler([])
    handler.received = int(signal.SIGUSR1)
    assert handler.agreed_signal(DistInfo()) == int(signal.SIGUSR1)
    window = LossWindow(torch.device("cpu"), DistInfo(), capacity=2)
    window.add(torch.tensor(float("inf")), samples=4, step=3, epoch=0, batch=3)
    assert window.full is False
    window.add(torch.tensor(1.0), samples=4, step=4, epoch=0, batch=4)
    reading = window.read()
    assert window.full is False and len(window) == 0
    assert reading.bad == Place(3, 0, 3, 4) and reading.samples == 8.0

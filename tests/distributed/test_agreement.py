"""The per-step agreement: one all-reduce carries the preemption signal, the non-finite-loss flag and the
logged loss window (two real gloo ranks)."""
import signal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed.runtime import DistInfo
from trainer.engine.preemption import PreemptionHandler

CASES = [  # per rank: (received signal, bad loss, loss window)
    [(signal.SIGUSR1, False, [1.5, 2.0]), (signal.SIGUSR2, True, [2.5, 3.0])],
    [(0, False, [0.25, 1.0]), (0, False, [float("nan"), 1.0])],
    [(0, False, None), (signal.SIGTERM, False, None)],
]


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, backend="gloo", local_world_size=2)
    got = []
    for case in CASES:
        received, bad, window = case[rank]
        handler = PreemptionHandler([])
        handler.received = int(received)
        signum, any_bad, sums = handler.agreed_signal(info, bad, None if window is None else torch.tensor(window))
        got.append((signum, any_bad, None if sums is None else sums.tolist()))
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


def test_one_all_reduce_agrees_on_signal_bad_loss_and_the_loss_window(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path / "got")), nprocs=2)
    got = [torch.load(tmp_path / f"got.{r}", weights_only=True) for r in (0, 1)]
    first, second, third = got[0]
    assert first == (int(signal.SIGUSR2), True, [4.0, 5.0])       # the highest signal; any rank's bad loss
    assert second[:2] == (0, False) and second[2][1] == 2.0 and second[2][0] != second[2][0]   # NaN stays its own
    assert third == (int(signal.SIGTERM), False, None)
    assert str(got[0]) == str(got[1])                                 # the same on every rank (NaN too)


def test_a_single_process_agrees_with_itself():
    handler = PreemptionHandler([])
    handler.received = int(signal.SIGUSR1)
    window = torch.tensor([3.0, 4.0], dtype=torch.float64)
    signum, bad, sums = handler.agreed_signal(DistInfo(), True, window)
    assert (signum, bad) == (int(signal.SIGUSR1), True) and sums is window

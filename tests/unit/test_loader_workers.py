"""Loader workers come from a fork server, not from the training process: a worker forked from a rank with
gloo's threads running blocked forever on a lock copied mid-use (2-rank CI runs, rank 0 waiting in its first
evaluation batch). The server ignores the preemption signals Slurm sends to every process of a task."""
import os
import signal

import torch

from trainer.engine.loader import PREEMPTION_SIGNALS, ShardSampler, make_loader


class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid(), os.getppid()])


def ignored_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)


def test_workers_are_forked_by_a_server_that_ignores_preemption_signals():
    handlers = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    rows = torch.cat(list(make_loader(Pids(), ShardSampler(4), 1, 2, None, 0)))
    assert sorted(rows[:, 0].tolist()) == [0, 1, 2, 3]                  # every sample once
    servers = set(rows[:, 2].tolist())
    assert len(set(rows[:, 1].tolist())) == 2 and os.getpid() not in servers
    (server,) = servers
    with open(f"/proc/{server}/status") as f:
        assert int(next(line for line in f if line.startswith("PPid:")).split()[1]) == os.getpid()
    wanted = sum(1 << (sig - 1) for sig in PREEMPTION_SIGNALS)
    assert ignored_signals(server) & wanted == wanted
    # the training process keeps its own handlers and an unchanged signal mask
    assert {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS} == handlers
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask


def test_no_workers_no_server_context():
    loader = make_loader(Pids(), ShardSampler(4), 2, 0, None, 0)
    assert loader.multiprocessing_context is None
    assert [b[:, 1].tolist() for b in loader] == [[os.getpid()] * 2] * 2

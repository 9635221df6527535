"""KGAT's batches drawn on the training device for the GPU-shaped step: the sampling tables of
sampling.PhaseSampler held there, and every batch drawn by torch's generator on the device, seeded from
(seed, rank, epoch, phase, batch) as the host plan's numpy stream is, so any batch of an epoch is rebuilt alone
(resume mid-epoch) and nothing is read by the host.

    plan = EpochPlan(DeviceTables(sampler, device), epoch, seed, rank, world, cf_batch, kg_batch)   # sampling.py
    batch = plan[7]        # {"phase": "cf", "tensors": (users, pos, neg)} on the device

The draws follow the host plan's rules with another random stream (torch's, not numpy's): users and heads without
replacement when the pool allows (a random permutation's first n), the positive a uniform pick among the
row's interactions or edges, and the negative the first of CANDIDATES uniform draws outside them (the host
rejects and draws again: a loop the host must read; a row linked to a fraction f of the candidates keeps a
linked one with probability f^CANDIDATES).
"""
from __future__ import annotations

import numpy as np
import torch

from trainer.recipes.kgat.sampling import PhaseSampler

CANDIDATES = 16


class DeviceTables:
    """PhaseSampler's tables as device tensors."""

    def __init__(self, sampler: PhaseSampler, device: torch.device):
        self.n_items, self.n_nodes, self.n_rel = sampler.n_items, sampler.n_nodes, sampler.n_rel
        self.n_cf, self.n_kg, self.device = sampler.n_cf, sampler.n_kg, device
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)   # noqa: E731
        self.cf_ptr, self.cf_items, self.cf_users, self.cf_keys = (
            t(sampler.cf_ptr), t(sampler.cf_items), t(sampler.cf_users), t(sampler.cf_keys))
        self.kg_ptr, self.kg_rels, self.kg_tails = t(sampler.kg_ptr), t(sampler.kg_rels), t(sampler.kg_tails)
        self.kg_heads, self.kg_keys = t(sampler.kg_heads), t(sampler.kg_keys)

    def stream(self, *key: int) -> torch.Generator:
        """The random stream of one batch, from (seed, rank, epoch, phase, batch): torch's generator there."""
        seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] & (2**63 - 1))
        return torch.Generator(self.device).manual_seed(seed)

    def pick(self, g: torch.Generator, pool: torch.Tensor, n: int) -> torch.Tensor:
        if n <= len(pool):
            return pool[torch.randperm(len(pool), generator=g, device=self.device)[:n]]
        return pool[torch.randint(0, len(pool), (n,), generator=g, device=self.device)]

    def negatives(self, g: torch.Generator, base: torch.Tensor, high: int, known: torch.Tensor) -> torch.Tensor:
        """Per row, the first of CANDIDATES values v in [0, high) with base + v not in the sorted `known`."""
        cand = torch.randint(0, high, (len(base), CANDIDATES), generator=g, device=self.device)
        keys = base[:, None] + cand
        at = torch.searchsorted(known, keys).clamp_(max=len(known) - 1)
        first = (known[at] != keys).to(torch.uint8).argmax(1, keepdim=True)
        return cand.gather(1, first).squeeze(1)

    def cf_batch(self, g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        users = self.pick(g, self.cf_users, n)
        start, deg = self.cf_ptr[users], self.cf_ptr[users + 1] - self.cf_ptr[users]
        pos = self.cf_items[start + (torch.rand(n, generator=g, device=self.device) * deg).long()]
        neg = self.negatives(g, users * self.n_items, self.n_items, self.cf_keys)
        return users, pos, neg

    def kg_batch(self, g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        heads = self.pick(g, self.kg_heads, n)
        start, deg = self.kg_ptr[heads], self.kg_ptr[heads + 1] - self.kg_ptr[heads]
        edge = start + (torch.rand(n, generator=g, device=self.device) * deg).long()
        rels, pos = self.kg_rels[edge], self.kg_tails[edge]
        neg = self.negatives(g, (heads * self.n_rel + rels) * self.n_nodes, self.n_nodes, self.kg_keys)
        return heads, rels, pos, neg

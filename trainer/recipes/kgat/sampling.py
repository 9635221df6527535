"""Per-rank batch sampling for KGAT's two phases, vectorised, reproducible from (seed, rank, epoch, batch).

CF batch: users drawn from those with training items (without replacement when the batch allows), one
training item each as the positive and one item the user never trained on as the negative (the original
code's sampler). KG batch: heads drawn from the collaborative KG, one of the head's edges (r, t) as the
positive, and a node t' with (h, r, t') not in the graph as the negative tail. Each batch has its own
random stream, so any batch of an epoch can be rebuilt alone (resume mid-epoch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.data.flat import Ragged
from trainer.recipes.kgat.data import CKG, KGATData

CF, KG = 0, 1
MAX_REJECTION_ROUNDS = 100


def csr(sets: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, indices) of per-row sorted id arrays (a Ragged already is one)."""
    if isinstance(sets, Ragged):
        return sets.offsets.astype(np.int64), sets.flat.astype(np.int64)
    indptr = np.zeros(len(sets) + 1, np.int64)
    indptr[1:] = np.cumsum([len(s) for s in sets])
    indices = np.concatenate(sets).astype(np.int64) if sets else np.zeros(0, np.int64)
    return indptr, indices


def _pick(rng: np.random.Generator, pool: np.ndarray, n: int) -> np.ndarray:
    """n ids from pool, without replacement when the pool is large enough (as the original's random.sample)."""
    return rng.choice(pool, n, replace=n > len(pool))


def _negatives(rng: np.random.Generator, owner_keys: np.ndarray, base: np.ndarray, high: int,
               known: np.ndarray) -> np.ndarray:
    """For each row, a value v in [0, high) with base + v not in the sorted array `known` (rejection)."""
    out = rng.integers(0, high, len(base))
    for _ in range(MAX_REJECTION_ROUNDS):
        keys = base + out
        pos = np.minimum(np.searchsorted(known, keys), len(known) - 1)
        bad = known[pos] == keys
        if not bad.any():
            return out
        out[bad] = rng.integers(0, high, int(bad.sum()))
    raise ValueError(f"could not draw negatives for ids {np.unique(owner_keys[bad])[:5].tolist()}: they are linked "
                     f"to (nearly) every candidate")


class PhaseSampler:
    """The sampling tables of one dataset (built once, shared by every epoch)."""

    def __init__(self, data: KGATData, ckg: CKG):
        self.n_items, self.n_nodes, self.n_rel = data.n_items, ckg.n_nodes, ckg.n_relations
        self.cf_ptr, self.cf_items = csr(data.train)
        deg = np.diff(self.cf_ptr)
        self.cf_users = np.nonzero(deg)[0]
        users = np.repeat(np.arange(len(deg)), deg)
        self.cf_keys = users * self.n_items + self.cf_items                 # sorted: users, then items
        self.n_cf = int(deg.sum())
        heads, rels, tails = (x.numpy() for x in (ckg.heads, ckg.rels, ckg.tails))
        self.kg_heads = np.unique(heads)
        self.kg_ptr = np.searchsorted(heads, np.arange(self.n_nodes + 1))
        self.kg_rels, self.kg_tails = rels, tails
        self.kg_keys = np.sort((heads * self.n_rel + rels) * self.n_nodes + tails)
        self.n_kg = len(heads)

    @staticmethod
    def stream(*key: int) -> np.random.Generator:
        """The random stream of one batch, from (seed, rank, epoch, phase, batch)."""
        return np.random.default_rng(list(key))

    def cf_batch(self, rng: np.random.Generator, n: int) -> tuple[torch.Tensor, ...]:
        """(users, positive items, negative items)."""
        users = _pick(rng, self.cf_users, n)
        start, deg = self.cf_ptr[users], np.diff(self.cf_ptr)[users]
        pos = self.cf_items[start + (rng.random(n) * deg).astype(np.int64)]
        neg = _negatives(rng, users, users * self.n_items, self.n_items, self.cf_keys)
        return tuple(torch.from_numpy(x.astype(np.int64)) for x in (users, pos, neg))

    def kg_batch(self, rng: np.random.Generator, n: int) -> tuple[torch.Tensor, ...]:
        """(heads, relations, positive tails, negative tails)."""
        heads = _pick(rng, self.kg_heads, n)
        start, deg = self.kg_ptr[heads], self.kg_ptr[heads + 1] - self.kg_ptr[heads]
        edge = start + (rng.random(n) * deg).astype(np.int64)
        rels, pos = self.kg_rels[edge], self.kg_tails[edge]
        neg = _negatives(rng, heads, (heads * self.n_rel + rels) * self.n_nodes, self.n_nodes, self.kg_keys)
        return tuple(torch.from_numpy(x.astype(np.int64)) for x in (heads, rels, pos, neg))


@dataclass(frozen=True)
class EpochPlan:
    """One rank's batches of an epoch: the CF phase, then the KG phase, drawn by `sampler` (PhaseSampler on the
    host, or device.DeviceTables on the training device: the same interface).

    The seed's batch rule: every rank draws cf_batch users and kg_batch triples per step, so the totals
    are cf_batch x world and kg_batch x world; an epoch covers the training interactions (CF) and the
    graph's edges (KG) once in expectation: n // total + 1 steps each, as in the original code.
    """

    sampler: Any
    epoch: int
    seed: int
    rank: int
    world: int
    cf_batch: int
    kg_batch: int

    @property
    def n_cf_steps(self) -> int:
        return self.sampler.n_cf // (self.cf_batch * self.world) + 1

    @property
    def n_kg_steps(self) -> int:
        return self.sampler.n_kg // (self.kg_batch * self.world) + 1

    def __len__(self) -> int:
        return self.n_cf_steps + self.n_kg_steps

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        phase, k = (CF, i) if i < self.n_cf_steps else (KG, i - self.n_cf_steps)
        rng = self.sampler.stream(self.seed, self.rank, self.epoch, phase, k)
        if phase == CF:
            return {"phase": "cf", "tensors": self.sampler.cf_batch(rng, self.cf_batch)}
        return {"phase": "kg", "tensors": self.sampler.kg_batch(rng, self.kg_batch)}


def batch_entries(indptr: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position in `rows`, column) of every entry of the CSR rows `rows`, row by row, columns sorted."""
    start, deg = indptr[rows], indptr[rows + 1] - indptr[rows]
    total = int(deg.sum())
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=indices.device), deg, output_size=total)
    first = torch.repeat_interleave(torch.cumsum(deg, 0) - deg - start, deg, output_size=total)
    return row_of, indices[torch.arange(total, device=indices.device) - first]


def rows_mask(indptr: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Dense (len(rows), width) bool mask of the CSR rows `rows`, built on the tensors' device."""
    out = torch.zeros(len(rows), width, dtype=torch.bool, device=indices.device)
    row_of, cols = batch_entries(indptr, indices, rows)
    out[row_of, cols] = True
    return out


def hits_of(indptr: torch.Tensor, indices: torch.Tensor, rows: torch.Tensor, top: torch.Tensor,
            width: int) -> torch.Tensor:
    """(len(rows), K) bool: is top[i, j] among the items of CSR row rows[i] (binary search, no dense mask);
    every id is below width."""
    row_of, cols = batch_entries(indptr, indices, rows)
    keys = row_of * width + cols                          # sorted: rows in order, columns sorted per row
    query = torch.arange(len(rows), device=top.device)[:, None] * width + top
    pos = torch.searchsorted(keys, query).clamp(max=max(len(keys) - 1, 0))
    return keys[pos] == query if len(keys) else torch.zeros_like(top, dtype=torch.bool)

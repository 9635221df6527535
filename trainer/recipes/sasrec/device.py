"""SASRec's training set held on the device for the GPU-shaped step: a batch is a gather of padded rows and
its negatives are drawn on the device, by the same counter-based stream as the CPU path's.

    data = DeviceSequences(train_set, torch.device("cuda"))
    batch = data.gather(torch.tensor([4, 9, 2], device="cuda"), epoch=3)   # seq, time, pos, neg

The CPU path (data.TrainSequences.negatives_of) draws the hash of (seed, epoch, user, slot, attempt) and draws
again, with the next attempt, where it hit the user's history: a loop whose length the host must read. Here
CANDIDATES attempts are drawn at once and the first outside the history is kept: the same item as the CPU
path's whenever one of the first CANDIDATES attempts is valid (a user who has seen a fraction f of the catalogue
keeps a seen item with probability f^CANDIDATES per slot: 1.5e-5 at f = 1/2), so "2-rank DDP equals one process"
and exact resume hold on either path.
"""
from __future__ import annotations

import numpy as np
import torch

from trainer.recipes.sasrec.data import DataError, TrainSequences, left_pad, mix64
from trainer.recipes.sasrec.negatives import PICK_SLOT, SHARED_SLOT, Sharing, epoch_base

CANDIDATES = 16
_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN, M1, M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of uint64 bits held in int64 (>> is arithmetic: it copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64_t(x: torch.Tensor) -> torch.Tensor:
    """data.mix64 (splitmix64's finaliser) on int64 tensors holding uint64 bits: the additions and products wrap
    as uint64's do (two's complement), so the bits are numpy's."""
    z = x + GOLDEN
    z = (z ^ _shr(z, 30)) * M1
    z = (z ^ _shr(z, 27)) * M2
    return z ^ _shr(z, 31)


def unsigned_mod(z: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """(uint64 bits of z) mod n for n < 2^31 (an int or a tensor of them), from its 32-bit halves (int64 % would see
    a negative number)."""
    hi, lo = _shr(z, 32), z & 0xFFFFFFFF
    return ((hi % n) * ((1 << 32) % n) + lo % n) % n


def unit_interval_t(z: torch.Tensor) -> torch.Tensor:
    """negatives.unit_interval on int64 tensors of uint64 bits: the top 53 bits as a float64 in [0, 1)."""
    return _shr(z, 11).double() * 2.0 ** -53


class DeviceSequences:
    """TrainSequences' samples as (users, maxlen) tensors on the device, the users' training histories sorted
    (padded with an id above every item) for the membership test of the negatives."""

    def __init__(self, train: TrainSequences, device: torch.device, candidates: int = CANDIDATES):
        split, maxlen = train.split, train.maxlen
        self.seed, self.negatives, self.num_items = train.seed, train.negatives, split.data.num_items
        self.sharing = train.sharing or Sharing()
        histories = [split.train(u) for u in train.users]
        seen = [np.unique(h) for h in histories]            # sorted: the membership test's rows
        full = next((u for u, items in zip(train.users, seen) if len(items) >= self.num_items), None)
        if full is not None:
            raise DataError(f"user {full} has interacted with every item: no negative can be sampled")
        rows = lambda f: torch.from_numpy(np.stack([f(u, h) for u, h in zip(train.users, histories)]))  # noqa: E731
        self.seq = rows(lambda u, h: left_pad(h[:-1], maxlen)).to(device)
        self.time = rows(lambda u, h: left_pad(split.data.times[u][: len(h)][:-1], maxlen)).to(device)
        self.pos = rows(lambda u, h: left_pad(h[1:], maxlen)).to(device)
        hist = np.full((len(seen), max(map(len, seen))), self.num_items + 1, dtype=np.int64)
        for i, items in enumerate(seen):
            hist[i, : len(items)] = items
        self.hist = torch.from_numpy(hist).to(device)
        self.users = torch.tensor(train.users, dtype=torch.int64, device=device)
        slots = maxlen * self.negatives
        # mix64(slot + attempt) for slots 1..S and attempts 0, S, 2S, ...: the user-independent half of a draw
        counters = np.arange(1, slots + 1, dtype=np.uint64)[None, :] + \
            (np.arange(candidates, dtype=np.uint64) * np.uint64(slots))[:, None]
        self.salts = torch.from_numpy(mix64(counters).view(np.int64)).to(device)      # (candidates, slots)
        shared_slots = mix64(SHARED_SLOT + np.arange(1, self.negatives + 1, dtype=np.uint64))
        self.shared_salts = torch.from_numpy(shared_slots.view(np.int64)).to(device)  # (negatives,)
        self.pick_salt = _signed(int(mix64(np.array([PICK_SLOT]))[0]))
        cdf = self.sharing.popularity
        self.cdf = None if cdf is None else torch.from_numpy(cdf).to(device)

    def __len__(self) -> int:
        return len(self.users)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.seq, self.time, self.pos, self.hist, self.salts))

    def gather(self, index: torch.Tensor, epoch: int) -> dict[str, torch.Tensor]:
        """The batch of samples `index` (a device tensor) in epoch `epoch`: collate's dict of (B, T) tensors."""
        pos = self.pos[index]
        if self.sharing.shared:
            neg, seen = self.draw_shared(index, epoch, pos)
            return dict(seq=self.seq[index], time=self.time[index], pos=pos, neg=neg, neg_seen=seen)
        neg = self.draw(index, epoch) * (pos != 0).unsqueeze(-1)
        return dict(seq=self.seq[index], time=self.time[index], pos=pos, neg=neg)

    def _items(self, z: torch.Tensor) -> torch.Tensor:
        """negatives.Sharing.items_of: uniform, or by popularity (the same float64 bits, the same search)."""
        if self.cdf is None:
            return unsigned_mod(z, self.num_items) + 1
        return torch.searchsorted(self.cdf, unit_interval_t(z), right=True) + 1

    def draw_shared(self, index: torch.Tensor, epoch: int, pos: torch.Tensor):
        """negatives.Sharing.draw on the device: (B, K) items and whether each is in its row's history."""
        base = int(epoch_base(self.seed, epoch))
        users = self.users[index]
        keys = mix64_t(users ^ _signed(base))                                             # (B,)
        b = len(index)
        if self.sharing.mode == "sequence":
            neg = self._items(mix64_t(keys[:, None] ^ self.shared_salts[None, :]))
        elif self.sharing.mode == "batch":
            z = mix64_t(users)
            lo, hi = (z & 0xFFFFFFFF).sum(), _shr(z, 32).sum()
            lo_mix = mix64_t(lo.reshape(1))
            key = mix64_t((lo_mix ^ hi) ^ _signed(base))
            neg = self._items(mix64_t(key ^ self.shared_salts)).expand(b, -1)
        else:
            real = (pos != 0).sum(1)
            back = unsigned_mod(mix64_t(keys ^ self.pick_salt), real)
            picks = pos.gather(1, (pos.shape[1] - 1 - back)[:, None])[:, 0]
            neg = picks.expand(b, -1)
        if not self.sharing.exclude_history:
            return neg, torch.zeros(neg.shape, dtype=torch.bool, device=neg.device)
        hist = self.hist[index]
        at = torch.searchsorted(hist, neg.contiguous()).clamp_(max=hist.shape[1] - 1)
        return neg, hist.gather(1, at) == neg

    def draw(self, index: torch.Tensor, epoch: int) -> torch.Tensor:
        """(B, T, negatives) items outside each user's history: of CANDIDATES draws per slot, the first valid."""
        base = int(mix64(mix64(np.array([self.seed], dtype=np.uint64)) ^ np.array([epoch], dtype=np.uint64))[0])
        key = mix64_t(self.users[index] ^ _signed(base))                           # (B,)
        items = unsigned_mod(mix64_t(key[:, None, None] ^ self.salts), self.num_items) + 1   # (B, C, S)
        b, c, s = items.shape
        hist = self.hist[index]
        at = torch.searchsorted(hist, items.view(b, c * s)).clamp_(max=hist.shape[1] - 1)
        seen = (hist.gather(1, at) == items.view(b, c * s)).view(b, c, s)
        first = (~seen).to(torch.uint8).argmax(1, keepdim=True)                    # the first valid attempt
        if not self.sharing.exclude_history:
            first = torch.zeros_like(first)
        return items.gather(1, first).view(b, -1, self.negatives)

"""SASRec's shared negatives (loss.shared_negatives): K items drawn once for every position of a sequence
(`sequence`: Klenitskiy & Vasilev's form), once for the whole batch (`batch`), or the batch's own targets, one per
sequence (`in_batch`); uniform or by training popularity (loss.negative_distribution). A drawn item that the
user has seen (loss.exclude_history) or that is a position's own target is masked, not drawn again, so the
proposal q stays what logQ correction divides by (log q: `log_q`).

    plan = Sharing.of(loss_cfg, D.popularity_scores(split))
    neg, seen = plan.draw(seed, epoch, users, histories, pos_rows)    # (B, K) items and (B, K) history marks

Like the per-position negatives (data.TrainSequences.negatives_of), every draw is a hash of (seed, epoch, user,
slot) (for `batch`: of the batch's users, in any order), so a resume draws the same items; device.py draws the
same bits on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.recipes.sasrec.data import mix64

SHARED_SLOT = np.uint64(1 << 40)    # shared draws' slots start here: no per-position (slot, attempt) reaches it
PICK_SLOT = SHARED_SLOT - np.uint64(1)   # in_batch: which of a sequence's targets it lends the batch
MODES = ("none", "sequence", "batch", "in_batch")


def epoch_base(seed: int, epoch: int) -> np.uint64:
    """The (seed, epoch) half of every draw's key (data.TrainSequences.negatives_of's too)."""
    return mix64(mix64(np.array([seed], dtype=np.uint64)) ^ np.array([epoch], dtype=np.uint64))[0]


def batch_key(base: np.uint64, users: np.ndarray) -> np.uint64:
    """One key for a batch, the same for its users in any order: the sums of their hashes' 32-bit halves (no
    wrapping sum, which torch does not promise)."""
    z = mix64(np.asarray(users, dtype=np.uint64))
    lo, hi = (z & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64), (z >> np.uint64(32)).sum(dtype=np.uint64)
    return mix64(np.array([base ^ mix64(np.array([lo]))[0] ^ hi], dtype=np.uint64))[0]


def unit_interval(z: np.ndarray) -> np.ndarray:
    """uint64 hashes as floats in [0, 1): their top 53 bits (torch: device.unit_interval_t, the same bits)."""
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@dataclass(frozen=True)
class Sharing:
    """How a batch's negatives are drawn when they are shared (mode != none)."""

    mode: str = "none"
    popularity: np.ndarray | None = None    # cumulative training popularity of items 1..N (popularity sampling)
    exclude_history: bool = True

    @classmethod
    def of(cls, loss_cfg, counts: np.ndarray | None) -> "Sharing":
        """From the loss config and the training popularity of every item (index 0: padding; None where the loss
        does not sample by popularity)."""
        cdf = None
        if loss_cfg.negative_distribution == "popularity":
            cdf = np.cumsum(counts[1:], dtype=np.float64)
            cdf /= cdf[-1]
        return cls(loss_cfg.shared_negatives, cdf, loss_cfg.exclude_history)

    @property
    def shared(self) -> bool:
        return self.mode != "none"

    def items_of(self, z: np.ndarray, num_items: int) -> np.ndarray:
        """Hashes as items in 1..num_items: uniform, or by popularity (inverse of the cumulative counts)."""
        if self.popularity is None:
            return (z % np.uint64(num_items)).astype(np.int64) + 1
        return np.searchsorted(self.popularity, unit_interval(z), side="right").astype(np.int64) + 1

    def draw(self, seed: int, epoch: int, users, negatives: int, num_items: int,
             histories: list[np.ndarray], pos_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, K) negatives of a batch and whether each is in its row's history (all False without
        exclude_history). pos_rows: the (B, T) left-padded targets (in_batch lends one of them per row)."""
        users = np.asarray(users, dtype=np.uint64)
        base = epoch_base(seed, epoch)
        keys = mix64(base ^ users)
        slots = mix64(SHARED_SLOT + np.arange(1, negatives + 1, dtype=np.uint64))
        if self.mode == "sequence":
            neg = self.items_of(mix64(keys[:, None] ^ slots[None, :]), num_items)
        elif self.mode == "batch":
            neg = np.broadcast_to(self.items_of(mix64(batch_key(base, users) ^ slots), num_items),
                                  (len(users), negatives)).copy()
        else:                        # in_batch: one target of each row, the same list for every row
            real = (pos_rows != 0).sum(1).astype(np.uint64)
            back = (mix64(keys ^ mix64(np.array([PICK_SLOT]))) % real).astype(np.int64)
            picks = pos_rows[np.arange(len(users)), pos_rows.shape[1] - 1 - back]
            neg = np.broadcast_to(picks, (len(users), len(users))).copy()
        seen = np.zeros(neg.shape, dtype=bool)
        if self.exclude_history:
            for row, history in enumerate(histories):
                seen[row] = np.isin(neg[row], history)
        return neg, seen


def log_q(counts: np.ndarray) -> np.ndarray:
    """log of each item's share of the training interactions (index 0 and unseen items: of one count), the
    proposal of popularity and in-batch sampling that logQ correction subtracts."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.log(np.maximum(counts, 1.0) / counts[1:].sum())

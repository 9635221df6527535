"""Per-user sequences as flat arrays with offsets (numpy only: a child process builds them without torch):
ids remapped, k-core, chronological order, TiSASRec's time rescaling; and the synthetic generator.

    data = build_sequences(read_interactions("u.data"), k=5)    # SeqData: data.seqs[u] is a view
    inter = synthesize(users=943, items=1349, mean_len=104, seed=0)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data import kernels
from trainer.data.flat import Ragged, codes, stable_order
from trainer.recipes.sasrec.read import DataError, Interactions, read_interactions


@dataclass
class SeqData:
    """Per-user chronological item sequences (items 1..num_items; 0 is padding) and rescaled times, flat."""

    seqs: Ragged
    times: Ragged
    num_items: int
    user_ids: np.ndarray | None = None     # each user's id in the data (code order), for predictions
    item_ids: np.ndarray | None = None     # item i's id in the data is item_ids[i - 1] (sorted as the codes are)

    def __post_init__(self):
        if not isinstance(self.seqs, Ragged):
            self.seqs = Ragged.of(self.seqs)
        if not isinstance(self.times, Ragged):
            self.times = Ragged.of(self.times)

    @property
    def num_users(self) -> int:
        return len(self.seqs)


def kcore(users: np.ndarray, items: np.ndarray, k: int) -> np.ndarray:
    """Mask of interactions kept by iterative k-core filtering of users and items."""
    keep = np.ones(len(users), dtype=bool)
    while k > 1:
        uc = np.bincount(users[keep], minlength=users.max() + 1)
        ic = np.bincount(items[keep], minlength=items.max() + 1)
        new = keep & (uc[users] >= k) & (ic[items] >= k)
        if new.sum() == keep.sum():
            break
        keep = new
    return keep


def rescale_times(times: np.ndarray) -> np.ndarray:
    """TiSASRec's per-user time: (t - t_min) / smallest non-zero gap, rounded, + 1 (0 stays padding)."""
    return rescale_flat(np.asarray(times, dtype=np.int64), np.array([0, len(times)], dtype=np.int64))


def rescale_flat(times: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """rescale_times of every user at once: `times` sorted within each user, users cut at `offsets` (every user
    with at least one time)."""
    counts = np.diff(offsets)
    if not len(times):
        return np.zeros(0, dtype=np.int64)
    done = kernels.rescale_times(times, offsets)
    if done is not None:
        return done
    big = np.iinfo(np.int64).max
    gaps = np.empty(len(times), dtype=np.int64)          # gaps[j] = times[j + 1] - times[j] within a user, else big
    np.subtract(times[1:], times[:-1], out=gaps[:-1])
    gaps[-1] = big
    gaps[offsets[1:-1] - 1] = big                        # the step from one user's last time to the next's first
    gaps[gaps == 0] = big
    scale = np.minimum.reduceat(gaps, offsets[:-1])      # each user's segment: its own gaps (and a big)
    scale[scale == big] = 1
    del gaps
    out = times - np.repeat(times[offsets[:-1]], counts)  # sorted: each user's first time is its smallest
    spread = np.repeat(scale, counts)
    if (scale == 1).all():                               # whole seconds apart somewhere: no division to round
        out += 1
        return out
    scaled = np.divide(out, spread, dtype=np.float64)
    del spread
    np.round(scaled, out=scaled)
    out[:] = scaled
    out += 1
    return out


def build_sequences(inter: Interactions, k: int = 0) -> SeqData:
    """Remap ids, apply k-core, order each user's items by time (stable), rescale times."""
    u, num_users, i, num_items = inter.coded()
    user_ids, item_ids = ids_of(inter.user_ids, u, num_users), ids_of(inter.item_ids, i, num_items)
    times = inter.times if inter.times is not None else np.zeros(len(u), dtype=np.int64)
    if k > 1:
        keep = kcore(u, i, k)
        if not keep.any():
            raise DataError(f"{k}-core filtering removed every interaction")
        u, i, times = u[keep], i[keep], times[keep]
        user_ids = user_ids[np.bincount(u, minlength=len(user_ids)) > 0]        # codes keep their order
        item_ids = item_ids[np.bincount(i, minlength=len(item_ids)) > 0]
        u, _ = codes(u)
        i, num_items = codes(i)
        order = stable_order(u, times)                      # by user, then time, then file order
    else:
        order = inter.chronological()
    offsets = np.concatenate([[0], np.cumsum(np.bincount(u))]).astype(np.int64)   # users need no sorting
    items = i[order]
    items += 1
    if inter.times is None:
        tflat = np.arange(len(u), dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets)) + 1
    else:
        tflat = rescale_flat(times[order], offsets)
    return SeqData(Ragged(items, offsets), Ragged(tflat, offsets), num_items, user_ids, item_ids)


def ids_of(raw: np.ndarray, coded: np.ndarray, count: int) -> np.ndarray:
    """The raw id of each code 0..count-1, as the file wrote it (text ids as fixed-width str: memory-mappable)."""
    raw = np.asarray(raw)
    out = np.empty(count, dtype=raw.dtype if raw.dtype.kind in "iuU" else str)
    if raw.dtype.kind not in "iuU":
        raw = raw.astype(str)
        out = np.empty(count, dtype=raw.dtype)
    out[coded] = raw
    return out


VECTORIZED_FROM = 1_000_000          # expected interactions from which synthesize draws all users at once


def _synthetic_model(items: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ring = rng.permutation(items)                       # the hidden sequential structure
    where = np.empty(items, dtype=np.int64)
    where[ring] = np.arange(items)
    popularity = 1.0 / np.arange(1, items + 1) ** 1.1  # Zipf-like, over a random order of items
    popularity = popularity[rng.permutation(items)]
    return ring, where, popularity / popularity.sum()


def synthesize(users: int, items: int, mean_len: int, seed: int, vectorized: bool | None = None) -> Interactions:
    """Sequences with power-law item popularity and learnable order: with probability 0.7 the next item
    is one of three successors of the current one on a fixed random ring, else a popular item. From
    VECTORIZED_FROM expected interactions on, every user's next step is drawn at once (the same model, another
    random stream: 20M interactions in seconds, where a draw per row took minutes); `vectorized` forces either."""
    if vectorized or vectorized is None and users * mean_len >= VECTORIZED_FROM:
        return _synthesize_vectorized(users, items, mean_len, seed)
    rng = np.random.default_rng(seed)
    ring, where, popularity = _synthetic_model(items, rng)
    out_u, out_i, out_t = [], [], []
    for u in range(users):
        length = max(5, int(rng.poisson(mean_len)))
        cur = int(rng.choice(items, p=popularity))
        t = int(rng.integers(8.8e8, 8.9e8))
        for _ in range(length):
            out_u.append(u + 1)
            out_i.append(cur + 1)
            out_t.append(t)
            t += int(rng.exponential(3600)) + 1
            if rng.random() < 0.7:
                cur = int(ring[(where[cur] + rng.integers(1, 4)) % items])
            else:
                cur = int(rng.choice(items, p=popularity))
    return Interactions(np.asarray(out_u, dtype=np.int64), np.asarray(out_i, dtype=np.int64),
                        np.asarray(out_t, dtype=np.int64))


def _synthesize_vectorized(users: int, items: int, mean_len: int, seed: int) -> Interactions:
    rng = np.random.default_rng(seed)
    ring, where, popularity = _synthetic_model(items, rng)
    lengths = np.maximum(5, rng.poisson(mean_len, users))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    by_length = np.argsort(-lengths, kind="stable")     # the users still drawing at step j are a prefix
    out_i = np.empty(offsets[-1], dtype=np.int64)
    out_t = np.empty(offsets[-1], dtype=np.int64)
    cur = rng.choice(items, users, p=popularity)[by_length]
    t = rng.integers(880_000_000, 890_000_000, users)[by_length]
    sorted_lengths, starts = lengths[by_length], offsets[:-1][by_length]
    for j in range(int(lengths.max())):
        n = int(np.searchsorted(-sorted_lengths, -j, side="left"))     # users longer than j
        cur, t = cur[:n], t[:n]
        out_i[starts[:n] + j] = cur + 1
        out_t[starts[:n] + j] = t
        t = t + rng.exponential(3600, n).astype(np.int64) + 1
        ring_next = ring[(where[cur] + rng.integers(1, 4, n)) % items]
        cur = np.where(rng.random(n) < 0.7, ring_next, rng.choice(items, n, p=popularity))
    return Interactions(np.repeat(np.arange(1, users + 1), lengths), out_i, out_t)


def write_udata(inter: Interactions, path: str | Path, chunk: int = 1_000_000) -> Path:
    """Write interactions as MovieLens u.data (user, item, rating 5, timestamp; tab-separated), in chunks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    times = inter.times if inter.times is not None else np.arange(len(inter))
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        for at in range(0, len(inter), chunk):
            part = [inter.user_ids[at:at + chunk], inter.item_ids[at:at + chunk], times[at:at + chunk]]
            fh.write(("%s\t%s\t5\t%s\n" * len(part[0])) % tuple(np.stack(part, 1).ravel().tolist()))
    tmp.replace(path)
    return path


def build_flat(path: str, fmt: str, duplicates: str, k: int,
               columns: tuple[str, str, str] = ("", "", "")) -> tuple[dict[str, np.ndarray], dict]:
    """The parsed-data cache's builder (trainer/data/cache.py): the file's sequences as flat arrays (items,
    times, offsets) and meta (num_items, rows)."""
    inter = read_interactions(path, fmt, duplicates, columns)
    data = build_sequences(inter, k)
    arrays = dict(items=data.seqs.flat, times=data.times.flat, offsets=data.seqs.offsets, user_ids=data.user_ids,
                  item_ids=data.item_ids)
    return arrays, dict(num_items=data.num_items, rows=len(inter))


def from_flat(arrays: dict[str, np.ndarray], meta: dict) -> SeqData:
    return SeqData(Ragged(arrays["items"], arrays["offsets"]), Ragged(arrays["times"], arrays["offsets"]),
                   int(meta["num_items"]), arrays.get("user_ids"), arrays.get("item_ids"))

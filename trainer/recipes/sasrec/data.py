"""Sequential-recommendation data: leave-one-out splits and the datasets, over flat arrays with offsets (a user's
sequence is a view, no array per user). Reading files: read.py; sequences and the generator: sequences.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data import cache
from trainer.recipes.sasrec.config import SeqDataConfig
from trainer.recipes.sasrec.read import (  # noqa: F401  (the recipe's data API)
    FOLDER_FILES,
    DataError,
    Interactions,
    data_files,
    read_interactions,
    resolve_path,
    without_duplicates,
)
from trainer.recipes.sasrec.sequences import (  # noqa: F401
    VECTORIZED_FROM,
    Ragged,
    SeqData,
    build_sequences,
    from_flat,
    kcore,
    rescale_flat,
    rescale_times,
    synthesize,
    write_udata,
)

log = logging.getLogger(__name__)


@dataclass
class Split:
    """Leave-one-out: the last item is the test target, the one before the validation target."""

    data: SeqData

    def train(self, u: int) -> np.ndarray:
        s = self.data.seqs[u]
        return s[:-2] if len(s) >= 3 else s

    def train_lengths(self) -> np.ndarray:
        """len(train(u)) of every user."""
        n = self.data.seqs.lengths()
        return np.where(n >= 3, n - 2, n)

    def has_targets(self, u: int) -> bool:
        return len(self.data.seqs[u]) >= 3

    def eval_input(self, u: int, split: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(items, times, target) for 'val' (history = train) or 'test' (history = train + val item)."""
        s, t = self.data.seqs[u], self.data.times[u]
        cut = len(s) - 2 if split == "val" else len(s) - 1
        return s[:cut], t[:cut], int(s[cut])


def left_pad(values: np.ndarray, length: int) -> np.ndarray:
    """The last `length` values, left-padded with zeros."""
    out = np.zeros(length, dtype=np.int64)
    tail = values[-length:]
    if len(tail):
        out[-len(tail):] = tail
    return out


def sample_negatives(rng: np.random.Generator, shape, num_items: int, exclude: np.ndarray) -> np.ndarray:
    """Items in 1..num_items not in `exclude`, by rejection sampling against a lookup table."""
    seen = np.zeros(num_items + 1, dtype=bool)
    seen[exclude] = True
    if seen[1:].all():
        raise DataError("a user has interacted with every item: no negative can be sampled")
    out = rng.integers(1, num_items + 1, size=shape)
    bad = seen[out]
    while bad.any():
        out[bad] = rng.integers(1, num_items + 1, size=int(bad.sum()))
        bad = seen[out]
    return out


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): a counter-based random stream, so the
    draws of a (seed, epoch, user, slot, attempt) need no generator object."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class TrainSequences(torch.utils.data.Dataset):
    """One sample per user with >= 2 training items: inputs, next-item targets, sampled negatives.
    Negatives depend only on (seed, epoch, user), so they do not change with the world size or with which
    users share a batch. The DataLoader fetches a batch at once (__getitems__): the negatives of all its
    users are drawn and checked against their histories in a few array operations (a generator and a
    rejection loop per user made the loader take 0.056 s of a 0.76 s ml-100k epoch; 0.040 s so)."""

    def __init__(self, split: Split, maxlen: int, negatives: int, seed: int, sharing=None):
        self.split, self.maxlen, self.negatives, self.seed = split, maxlen, negatives, seed
        self.sharing = sharing            # negatives.Sharing: shared negatives (loss.shared_negatives), or None
        self.users = np.flatnonzero(split.train_lengths() >= 2)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.users)

    def lengths(self) -> list[int]:
        """Positions each sample fills (its input sequence, at most maxlen): what its step costs."""
        return np.minimum(self.split.train_lengths()[self.users] - 1, self.maxlen).tolist()

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([idx])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        users = [self.users[i] for i in indices]
        histories = [self.split.train(u) for u in users]
        rows = np.stack([left_pad(items[1:], self.maxlen) for items in histories])
        shared = self.sharing is not None and self.sharing.shared
        if shared:
            negs, seen = self.sharing.draw(self.seed, self.epoch, users, self.negatives, self.split.data.num_items,
                                           histories, rows)
        else:
            negs = self.negatives_of(users, histories)
        out = []
        for i, (u, items, neg, pos) in enumerate(zip(users, histories, negs, rows)):
            times = self.split.data.times[u][: len(items)]
            sample = dict(seq=torch.from_numpy(left_pad(items[:-1], self.maxlen)),
                          time=torch.from_numpy(left_pad(times[:-1], self.maxlen)), pos=torch.from_numpy(pos))
            if shared:
                sample.update(neg=torch.from_numpy(neg), neg_seen=torch.from_numpy(seen[i]))
            else:
                neg[pos == 0] = 0
                sample["neg"] = torch.from_numpy(neg)
            out.append(sample)
        return out

    def negatives_of(self, users: list[int], histories: list[np.ndarray]) -> np.ndarray:
        """(len(users), maxlen, negatives) items in 1..num_items outside each user's history: the hash of
        (seed, epoch, user, slot, attempt), drawn again (next attempt) where it hit the history. Membership
        is a binary search in the sorted (row, item) codes of the histories: memory grows with the
        histories, not with the catalogue."""
        n_items, slots, n = self.split.data.num_items, self.maxlen * self.negatives, len(users)
        rows = np.repeat(np.arange(n), [len(h) for h in histories])
        codes = np.unique(rows * (n_items + 1) + np.concatenate(histories))
        distinct = np.bincount(codes // (n_items + 1), minlength=n)      # histories hold items 1..num_items
        if (distinct >= n_items).any():
            full = int(np.argmax(distinct >= n_items))
            raise DataError(f"user {users[full]} has interacted with every item: no negative can be sampled")
        base = mix64(mix64(np.array([self.seed], dtype=np.uint64)) ^ np.array([self.epoch], dtype=np.uint64))
        key = mix64(base ^ np.asarray(users, dtype=np.uint64)).repeat(slots)              # (n * slots,)
        slot = np.tile(np.arange(1, slots + 1, dtype=np.uint64), n)
        row = np.arange(n).repeat(slots)

        def draw(where, attempt):
            return (mix64(key[where] ^ mix64(slot[where] + attempt)) % np.uint64(n_items)).astype(np.int64) + 1

        def in_history(items, where):
            query = row[where] * (n_items + 1) + items
            at = np.minimum(np.searchsorted(codes, query), len(codes) - 1)
            return codes[at] == query

        attempt = np.uint64(0)
        neg = draw(slice(None), attempt)
        if self.sharing is not None and not self.sharing.exclude_history:
            return neg.reshape(n, self.maxlen, self.negatives)
        todo = np.flatnonzero(in_history(neg, slice(None)))
        while len(todo):
            attempt += np.uint64(slots)
            neg[todo] = draw(todo, attempt)
            todo = todo[in_history(neg[todo], todo)]
        return neg.reshape(n, self.maxlen, self.negatives)


class EvalSequences(torch.utils.data.Dataset):
    """Users with a target in `split`: history, target and 100 fixed negatives never interacted with.

    Each sample is built at its first use and kept for every later evaluation, in arrays made once for all the
    users (a row each; the histories one flat array): built one small allocation at a time between the scoring's
    [batch x items] temporaries, the kept samples pinned those freed blocks in the engine's heap (no mmap, no
    trimming: trainer/native/memory.py), and a first evaluation of Amazon Beauty's 40,226 users grew the process
    by 1.7 GB where the same samples built beforehand took 0.2."""

    def __init__(self, split: Split, which: str, maxlen: int, negatives: int, seed: int, max_users: int = 0):
        self.split, self.which, self.maxlen, self.negatives, self.seed = split, which, maxlen, negatives, seed
        self.users = np.flatnonzero(split.data.seqs.lengths() >= 3)
        if 0 < max_users < len(self.users):
            # a sample drawn from the seed alone: the same users for val and test and at every evaluation; the first
            # ids would be the oldest accounts, which on Amazon Beauty score well below the whole set (bench/README.md)
            pick = np.random.default_rng([seed, 3]).choice(len(self.users), max_users, replace=False)
            self.users = self.users[np.sort(pick)]
        self._store: dict[str, np.ndarray] | None = None      # made at the first sample in each process

    def __len__(self) -> int:
        return len(self.users)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_store"] = None       # a loader worker builds the samples it serves, as before: no copy of the arrays
        return state

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        store = self._store if self._store is not None else self._allocate()
        if not store["built"][idx]:  # samples are fixed: build each once, reuse at every evaluation
            self._build(idx, store)
        start, n = store["history_at"][idx], store["history_len"][idx]
        return dict(seq=torch.from_numpy(store["seq"][idx]), time=torch.from_numpy(store["time"][idx]),
                    candidates=torch.from_numpy(store["candidates"][idx]),
                    history=torch.from_numpy(store["history"][start:start + n]))

    def _allocate(self) -> dict[str, np.ndarray]:
        """Every sample's room, zeroed (pages are committed as samples are written); a history holds at most the
        user's input items."""
        seqs, n = self.split.data.seqs, len(self.users)
        inputs = seqs.lengths()[self.users] - (2 if self.which == "val" else 1)
        at = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(inputs, out=at[1:])
        item_dtype = seqs[self.users[0]].dtype if n else np.int64
        self._store = dict(seq=np.zeros((n, self.maxlen), dtype=np.int64),        # left_pad's dtype
                           time=np.zeros((n, self.maxlen), dtype=np.int64),
                           candidates=np.zeros((n, self.negatives + 1), dtype=np.int64),
                           history=np.zeros(at[-1], dtype=item_dtype), history_at=at[:-1],
                           history_len=np.zeros(n, dtype=np.int64), built=np.zeros(n, dtype=bool))
        return self._store

    def _build(self, idx: int, store: dict[str, np.ndarray]) -> None:
        u = self.users[idx]
        items, times, target = self.split.eval_input(u, self.which)
        rng = np.random.default_rng([self.seed, 1 if self.which == "val" else 2, u])
        negs = sample_negatives(rng, self.negatives, self.split.data.num_items, self.split.data.seqs[u])
        history = np.unique(items)
        history = history[history != target]
        store["seq"][idx] = left_pad(items, self.maxlen)
        store["time"][idx] = left_pad(times, self.maxlen)
        store["candidates"][idx, 0] = target
        store["candidates"][idx, 1:] = negs
        start = store["history_at"][idx]
        store["history"][start:start + len(history)] = history
        store["history_len"][idx] = len(history)
        store["built"][idx] = True


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal shapes; right-pad variable-length 1-D tensors (histories) with 0."""
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if all(v.shape == values[0].shape for v in values):
            out[key] = torch.stack(values)
        else:
            out[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=0)
    return out


# the parse's version (2: the raw user and item ids kept): part of the cache key (a change rebuilds every entry)
READER = 2


def load(cfg: SeqDataConfig, local_rank: int = 0) -> SeqData:
    """The configured dataset: a file/folder (parsed once into the data cache, memory-mapped after), or
    synthetic data when data.path is empty."""
    columns = (cfg.user_column, cfg.item_column, cfg.time_column)
    if not cfg.path:
        data = build_sequences(synthesize(cfg.synthetic_users, cfg.synthetic_items, cfg.synthetic_mean_len,
                                          cfg.synthetic_seed))
    elif (root := cache.root_of(cfg.cache)) is None:
        data = build_sequences(read_interactions(cfg.path, cfg.format, cfg.duplicates, columns), cfg.kcore)
    else:
        path = resolve_path(cfg.path).resolve()
        settings = dict(format=cfg.format, duplicates=cfg.duplicates, kcore=cfg.kcore, columns=list(columns),
                        reader=READER)
        arrays, meta = cache.load_or_build_files(root, "sasrec", path, data_files(path), settings,
                                                 "trainer.recipes.sasrec.sequences:build_flat",
                                                 (str(path), cfg.format, cfg.duplicates, cfg.kcore, columns),
                                                 local_rank, error=DataError, cap_gb=cfg.cache_cap_gb)
        data = from_flat(arrays, meta)
    lengths = data.seqs.lengths()
    log.info("sequences: %d users, %d items, %d interactions, mean length %.1f (%s)", data.num_users,
             data.num_items, lengths.sum(), lengths.mean(), cfg.path or "synthetic")
    return data


POPULARITY_CHUNK = 1 << 22      # items counted at a time: a chunk's int64 copy is 32 MB whatever the data's size


def popularity_scores(split: Split) -> np.ndarray:
    """Training-set popularity of every item (index 0 unused): the baseline a model must beat. Every interaction
    counted in chunks, less the held-out ones (each user's last two, where it has three or more): temporaries of one
    chunk and of the users, not of the interactions (a position per interaction held 480 MB at MovieLens-20M's size,
    issue 88)."""
    seqs, size = split.data.seqs, split.data.num_items + 1
    counts = np.zeros(size, dtype=np.int64)
    for start in range(0, len(seqs.flat), POPULARITY_CHUNK):
        counts += np.bincount(np.asarray(seqs.flat[start:start + POPULARITY_CHUNK], dtype=np.intp), minlength=size)
    held = seqs.lengths() - split.train_lengths()
    ends = np.asarray(seqs.offsets[1:], dtype=np.int64)
    for k in range(1, int(held.max(initial=0)) + 1):
        counts -= np.bincount(np.asarray(seqs.flat[ends[held >= k] - k], dtype=np.intp), minlength=size)
    return counts.astype(np.float64)

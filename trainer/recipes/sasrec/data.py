"""Sequential-recommendation data: parsers, k-core, leave-one-out, per-user time rescaling, datasets.

Formats (auto-detected from the first line, or data.format):
  pairs  `user item` per line, already in time order (SASRec's ml-1m.txt)
  udata  `user item rating timestamp`, tab/space separated (MovieLens u.data, TiSASRec's ml-1m.txt)
  dat    `user::item::rating::timestamp` (MovieLens ratings.dat)
  csv    a header naming user and item columns (and optionally timestamp)
"""
from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.text import finite, read_text, text_lines
from trainer.recipes.sasrec.config import SeqDataConfig

log = logging.getLogger(__name__)
FOLDER_FILES = ("u.data", "ratings.dat", "ratings.csv", "interactions.tsv", "interactions.csv", "ratings.tsv")
USER_COLS = ("user", "user_id", "userid", "uid")
ITEM_COLS = ("item", "item_id", "itemid", "movie_id", "movieid", "iid")
TIME_COLS = ("timestamp", "time", "ts", "datetime")


class DataError(ValueError):
    """Malformed input; the message names the file, line and field."""


@dataclass
class Interactions:
    """Parsed interactions as parallel arrays (raw ids as strings; time may be absent)."""

    users: list[str]
    items: list[str]
    times: np.ndarray | None
    lines: list[int] | None = None        # each row's line in the file (for messages)


@dataclass
class SeqData:
    """Per-user chronological item sequences (items 1..num_items; 0 is padding) and rescaled times."""

    seqs: list[np.ndarray]
    times: list[np.ndarray]
    num_items: int

    @property
    def num_users(self) -> int:
        return len(self.seqs)


def _detect(first: str, path: Path) -> str:
    if path.suffix == ".csv" or ("," in first and "::" not in first):
        return "csv"
    if "::" in first:
        return "dat"
    n = len(first.split())
    return {2: "pairs", 3: "udata", 4: "udata"}.get(n, "unknown")


def _int(value: str, path: Path, line: int, field: str) -> int:
    try:
        return int(value)
    except ValueError:
        try:
            as_float = float(value)
        except ValueError:
            as_float = None
        if as_float is not None and as_float.is_integer():
            return int(as_float)
        raise DataError(f"{path}:{line}: field '{field}': {value!r} is not an integer") from None


def _id(value: str, path: Path, line: int, field: str) -> str:
    """An id of a format whose ids are integers, written as one: `1.0` would become a second id beside `1`."""
    if value.isdigit() and value.isascii():
        return str(int(value))
    what = "a negative id" if value.startswith("-") and value[1:].isdigit() else "not an integer id"
    raise DataError(f"{path}:{line}: field '{field}': {value!r} is {what} (ids in this format are whole numbers "
                    f">= 0, written without a decimal point)")


def _read_delimited(path: Path, fmt: str) -> Interactions:
    users, items, times, lines = [], [], [], []
    sep = "::" if fmt == "dat" else None
    expected = {"pairs": (2, 2), "udata": (3, 4), "dat": (4, 4)}[fmt]
    for no, line in text_lines(path, DataError):
        if not line.strip():
            continue
        parts = line.strip().split(sep)
        if not expected[0] <= len(parts) <= expected[1]:
            raise DataError(f"{path}:{no}: expected {'-'.join(map(str, sorted(set(expected))))} fields "
                            f"({fmt} format), got {len(parts)}: {line.strip()[:80]!r}")
        users.append(_id(parts[0], path, no, "user"))
        items.append(_id(parts[1], path, no, "item"))
        lines.append(no)
        if fmt != "pairs":
            times.append(_int(parts[-1], path, no, "timestamp"))
            if len(parts) == 4:
                try:
                    rating = float(parts[2])
                except ValueError:
                    raise DataError(f"{path}:{no}: field 'rating': {parts[2]!r} is not a number") from None
                finite(rating, path, no, "rating", DataError)
    return Interactions(users, items, np.asarray(times, dtype=np.int64) if fmt != "pairs" else None, lines)


def _read_csv(path: Path) -> Interactions:
    with io.StringIO(read_text(path, DataError), newline="") as fh:
        reader = csv.reader(fh)
        header = [h.strip().lower() for h in next(reader, [])]

        def col(names, required):
            found = next((header.index(n) for n in names if n in header), None)
            if found is None and required:
                raise DataError(f"{path}:1: header {header} names no {names[0]} column "
                                f"(accepted: {', '.join(names)})")
            return found
        u, i, t = col(USER_COLS, True), col(ITEM_COLS, True), col(TIME_COLS, False)
        users, items, times, lines = [], [], [], []
        for no, row in enumerate(reader, 2):
            if not row or not any(c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise DataError(f"{path}:{no}: expected {len(header)} fields, got {len(row)}")
            for idx, name in ((u, "user"), (i, "item")):
                if not row[idx].strip():
                    raise DataError(f"{path}:{no}: field '{name}' is empty")
            users.append(row[u].strip())
            items.append(row[i].strip())
            lines.append(no)
            if t is not None:
                times.append(_int(row[t].strip(), path, no, "timestamp"))
    return Interactions(users, items, np.asarray(times, dtype=np.int64) if t is not None else None, lines)


def resolve_path(path: str | Path) -> Path:
    """A file, or the first known interactions file inside a folder."""
    p = Path(path)
    if p.is_dir():
        for name in FOLDER_FILES:
            if (p / name).is_file():
                return p / name
        txt = sorted(p.glob("*.txt"))
        if len(txt) == 1:
            return txt[0]
        raise DataError(f"{p}: no interactions file found (looked for {', '.join(FOLDER_FILES)} or one *.txt)")
    if not p.is_file():
        raise DataError(f"data.path {p} does not exist")
    return p


def read_interactions(path: str | Path, fmt: str = "auto", duplicates: str = "drop") -> Interactions:
    """Parse an interactions file in one of the supported formats; repeated interactions (the same user, item
    and time) are dropped with a warning, kept, or refused (`duplicates`)."""
    p = resolve_path(path)
    first = next((line for _, line in text_lines(p, DataError) if line.strip()), "")
    if not first:
        raise DataError(f"{p}: the file is empty")
    fmt = _detect(first, p) if fmt == "auto" else fmt
    if fmt == "unknown":
        raise DataError(f"{p}:1: cannot tell the format from {first.strip()[:80]!r}; set data.format")
    data = _read_csv(p) if fmt == "csv" else _read_delimited(p, fmt)
    if not data.users:
        raise DataError(f"{p}: no interactions")
    return without_duplicates(data, p, duplicates)


def without_duplicates(data: Interactions, path: Path, policy: str) -> Interactions:
    """Rows repeating an earlier row's user, item and time (user and item where the file has no time): a
    double export, a concatenation run twice. They would count twice in the sequences and the targets."""
    times = data.times if data.times is not None else np.zeros(len(data.users), dtype=np.int64)
    seen: dict[tuple, int] = {}
    repeats = []
    for k, key in enumerate(zip(data.users, data.items, times.tolist())):
        if key in seen:
            repeats.append((k, seen[key]))
        else:
            seen[key] = k
    if not repeats or policy == "keep":
        return data
    k, first = repeats[0]
    at = f"first at line {data.lines[k]} (repeating line {data.lines[first]})" if data.lines else ""
    what = f"{path}: {len(repeats)} duplicate interaction(s) (the same user, item and time), {at}"
    if policy == "error":
        raise DataError(f"{what}.\nHINT: remove them, or set data.duplicates=drop (or keep).")
    log.warning("%s: dropped (data.duplicates=keep keeps them, =error refuses the file)", what)
    keep = np.ones(len(data.users), dtype=bool)
    keep[[k for k, _ in repeats]] = False
    pick = np.flatnonzero(keep).tolist()
    return Interactions([data.users[k] for k in pick], [data.items[k] for k in pick],
                        None if data.times is None else data.times[keep],
                        [data.lines[k] for k in pick] if data.lines else None)


def _codes(raw: list[str]) -> tuple[np.ndarray, int]:
    """Contiguous codes 0..K-1 in order of the raw ids (numerically when they are all integers)."""
    values = np.asarray(raw)
    try:
        keys = values.astype(np.int64)
    except ValueError:
        keys = values
    uniq, codes = np.unique(keys, return_inverse=True)
    return codes.astype(np.int64), len(uniq)


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
    gaps = np.diff(times)
    gaps = gaps[gaps != 0]
    scale = gaps.min() if len(gaps) else 1
    return np.round((times - times.min()) / scale).astype(np.int64) + 1


def build_sequences(inter: Interactions, k: int = 0) -> SeqData:
    """Remap ids, apply k-core, order each user's items by time (stable), rescale times."""
    u, _ = _codes(inter.users)
    i, _ = _codes(inter.items)
    times = inter.times if inter.times is not None else np.zeros(len(u), dtype=np.int64)
    order_in_file = np.arange(len(u))
    if k > 1:
        keep = kcore(u, i, k)
        if not keep.any():
            raise DataError(f"{k}-core filtering removed every interaction")
        u, i, times, order_in_file = u[keep], i[keep], times[keep], order_in_file[keep]
        u, _ = _codes(u.astype(str).tolist())
        i, _ = _codes(i.astype(str).tolist())
    num_items = int(i.max()) + 1
    order = np.lexsort((order_in_file, times, u))          # by user, then time, then file order
    u, i, times = u[order], i[order] + 1, times[order]
    bounds = np.flatnonzero(np.diff(u)) + 1
    seqs = np.split(i, bounds)
    tseq = np.split(times, bounds)
    if inter.times is None:
        tseq = [np.arange(1, len(s) + 1, dtype=np.int64) for s in seqs]
    else:
        tseq = [rescale_times(t) for t in tseq]
    return SeqData(seqs, tseq, num_items)


@dataclass
class Split:
    """Leave-one-out: the last item is the test target, the one before the validation target."""

    data: SeqData

    def train(self, u: int) -> np.ndarray:
        s = self.data.seqs[u]
        return s[:-2] if len(s) >= 3 else s

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

    def __init__(self, split: Split, maxlen: int, negatives: int, seed: int):
        self.split, self.maxlen, self.negatives, self.seed = split, maxlen, negatives, seed
        self.users = [u for u in range(split.data.num_users) if len(split.train(u)) >= 2]
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.users)

    def lengths(self) -> list[int]:
        """Positions each sample fills (its input sequence, at most maxlen): what its step costs."""
        return [min(len(self.split.train(u)) - 1, self.maxlen) for u in self.users]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([idx])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        users = [self.users[i] for i in indices]
        histories = [self.split.train(u) for u in users]
        negs = self.negatives_of(users, histories)
        out = []
        for u, items, neg in zip(users, histories, negs):
            times = self.split.data.times[u][: len(items)]
            seq, pos = left_pad(items[:-1], self.maxlen), left_pad(items[1:], self.maxlen)
            neg[pos == 0] = 0
            out.append(dict(seq=torch.from_numpy(seq), time=torch.from_numpy(left_pad(times[:-1], self.maxlen)),
                            pos=torch.from_numpy(pos), neg=torch.from_numpy(neg)))
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
        todo = np.flatnonzero(in_history(neg, slice(None)))
        while len(todo):
            attempt += np.uint64(slots)
            neg[todo] = draw(todo, attempt)
            todo = todo[in_history(neg[todo], todo)]
        return neg.reshape(n, self.maxlen, self.negatives)


class EvalSequences(torch.utils.data.Dataset):
    """Users with a target in `split`: history, target and 100 fixed negatives never interacted with."""

    def __init__(self, split: Split, which: str, maxlen: int, negatives: int, seed: int, max_users: int = 0):
        self.split, self.which, self.maxlen, self.negatives, self.seed = split, which, maxlen, negatives, seed
        self.users = [u for u in range(split.data.num_users) if split.has_targets(u)]
        if max_users > 0:
            self.users = self.users[:max_users]
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if idx not in self._cache:  # samples are fixed: build each once, reuse at every evaluation
            self._cache[idx] = self._build(self.users[idx])
        return self._cache[idx]

    def _build(self, u: int) -> dict[str, torch.Tensor]:
        items, times, target = self.split.eval_input(u, self.which)
        rng = np.random.default_rng([self.seed, 1 if self.which == "val" else 2, u])
        negs = sample_negatives(rng, self.negatives, self.split.data.num_items, self.split.data.seqs[u])
        history = np.unique(items)
        return dict(seq=torch.from_numpy(left_pad(items, self.maxlen)),
                    time=torch.from_numpy(left_pad(times, self.maxlen)),
                    candidates=torch.from_numpy(np.concatenate([[target], negs]).astype(np.int64)),
                    history=torch.from_numpy(history[history != target]))


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


def synthesize(users: int, items: int, mean_len: int, seed: int) -> Interactions:
    """Sequences with power-law item popularity and learnable order: with probability 0.7 the next item
    is one of three successors of the current one on a fixed random ring, else a popular item."""
    rng = np.random.default_rng(seed)
    ring = rng.permutation(items)                       # the hidden sequential structure
    where = np.empty(items, dtype=np.int64)
    where[ring] = np.arange(items)
    popularity = 1.0 / np.arange(1, items + 1) ** 1.1  # Zipf-like, over a random order of items
    popularity = popularity[rng.permutation(items)]
    popularity /= popularity.sum()
    out_u, out_i, out_t = [], [], []
    for u in range(users):
        length = max(5, int(rng.poisson(mean_len)))
        cur = int(rng.choice(items, p=popularity))
        t = int(rng.integers(8.8e8, 8.9e8))
        for _ in range(length):
            out_u.append(str(u + 1))
            out_i.append(str(cur + 1))
            out_t.append(t)
            t += int(rng.exponential(3600)) + 1
            if rng.random() < 0.7:
                cur = int(ring[(where[cur] + rng.integers(1, 4)) % items])
            else:
                cur = int(rng.choice(items, p=popularity))
    return Interactions(out_u, out_i, np.asarray(out_t, dtype=np.int64))


def write_udata(inter: Interactions, path: str | Path) -> Path:
    """Write interactions as MovieLens u.data (user, item, rating 5, timestamp; tab-separated)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    times = inter.times if inter.times is not None else np.arange(len(inter.users))
    with open(path, "w") as fh:
        for u, i, t in zip(inter.users, inter.items, times):
            fh.write(f"{u}\t{i}\t5\t{t}\n")
    return path


def load(cfg: SeqDataConfig) -> SeqData:
    """The configured dataset: a file/folder, or synthetic data when data.path is empty."""
    if cfg.path:
        inter = read_interactions(cfg.path, cfg.format, cfg.duplicates)
    else:
        inter = synthesize(cfg.synthetic_users, cfg.synthetic_items, cfg.synthetic_mean_len, cfg.synthetic_seed)
    data = build_sequences(inter, cfg.kcore)
    lengths = np.array([len(s) for s in data.seqs])
    log.info("sequences: %d users, %d items, %d interactions, mean length %.1f (%s)", data.num_users,
             data.num_items, lengths.sum(), lengths.mean(), cfg.path or "synthetic")
    return data


def popularity_scores(split: Split) -> np.ndarray:
    """Training-set popularity of every item (index 0 unused): the baseline a model must beat."""
    counts = np.zeros(split.data.num_items + 1)
    for u in range(split.data.num_users):
        np.add.at(counts, split.train(u), 1)
    return counts

"""SASRec's predictions (`trainer predict`): each user's top-K items in the data's own ids, scored as the full-ranking
evaluation scores them (recipe.ranked_scores), from the user's whole history (or its training part).

    python -m trainer predict --checkpoint runs/sasrec --out top10.csv --top-k 10 [--users ids.txt] [--keep-seen]

Columns: user, rank (1 = best), item, score. Ties go to the item listed first in the data's id order (its lower
code). Seen items are left out unless --keep-seen; a user with fewer than K unseen items gets fewer rows.
--data FILE scores the users of another file with the checkpoint's catalogue: its items unknown to the checkpoint are
dropped (counted in one line), a user left with none is skipped (counted too).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch

from trainer.data.flat import Ragged
from trainer.engine.predict import PredictRequest, as_numpy, top_k
from trainer.engine.predict_parts import PredictError
from trainer.recipes.sasrec import data as D

log = logging.getLogger(__name__)


def lookup_codes(known: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each id's position in `known` (ids in their code order: sorted numerically, or as text), -1 where absent."""
    known, ids = np.asarray(known), np.asarray(ids)
    if known.dtype.kind not in "iu" or ids.dtype.kind not in "iu":
        try:
            known, ids = known.astype(np.int64), ids.astype(np.int64)
        except (ValueError, OverflowError):
            table = {str(k): n for n, k in enumerate(known.tolist())}
            return np.array([table.get(str(x), -1) for x in ids.tolist()], dtype=np.int64)
    at = np.minimum(np.searchsorted(known, ids), max(len(known) - 1, 0))
    return np.where(len(known) and known[at] == ids, at, -1) if len(known) else np.full(len(ids), -1)


@dataclasses.dataclass
class Histories:
    """The users to predict for: their items (the checkpoint's codes) and times, and their ids."""

    seqs: Ragged
    times: Ragged
    user_ids: np.ndarray


def histories(recipe, request: PredictRequest) -> Histories:
    """The checkpoint's own data, or request.data read as training reads it and put on the checkpoint's items."""
    own = recipe.data
    cfg = recipe.data_cfg
    if not request.data or (cfg.path and Path(request.data).resolve() == D.resolve_path(cfg.path).resolve()):
        if own.user_ids is None:
            raise PredictError("the data was read without its ids (an older cache entry): run again with "
                               "data.cache=off")
        if request.history == "train":
            split = recipe.split
            train = [split.train(u) for u in range(own.num_users)]
            times = [own.times[u][: len(t)] for u, t in enumerate(train)]
            return Histories(Ragged.of(train), Ragged.of(times), own.user_ids)
        return Histories(own.seqs, own.times, own.user_ids)
    new = D.load(dataclasses.replace(cfg, path=request.data, kcore=0), getattr(recipe.dist, "local_rank", 0))
    codes = lookup_codes(own.item_ids, new.item_ids) + 1             # the new data's item i -> ours (0: unknown)
    items = codes[new.seqs.flat - 1]
    known = items > 0
    if not known.all():
        log.info("%s: %d of %d interactions are of %d items the checkpoint does not know: dropped", request.data,
                 int((~known).sum()), len(known), int((codes == 0).sum()))
    owner = np.repeat(np.arange(new.num_users), new.seqs.lengths())[known]
    counts = np.bincount(owner, minlength=new.num_users)
    if (counts == 0).any():
        log.info("%s: %d users have no item the checkpoint knows: skipped", request.data, int((counts == 0).sum()))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Histories(Ragged(items[known], offsets), Ragged(new.times.flat[known], offsets), new.user_ids)


def units(recipe, request: PredictRequest) -> np.ndarray:
    """The users (rows of the histories) to predict for: every user with a known item, or the listed ones."""
    recipe.histories = h = histories(recipe, request)
    present = np.flatnonzero(h.seqs.lengths() > 0)
    if not request.users:
        return present
    listed = np.array([line.strip() for line in Path(request.users).read_text().splitlines() if line.strip()])
    rows = lookup_codes(h.user_ids, listed)
    absent = listed[(rows < 0) | ~np.isin(rows, present)]
    if len(absent):
        raise PredictError(f"--users {request.users}: {len(absent)} of {len(listed)} users have no history in the "
                           f"data ({', '.join(absent[:5].tolist())}{', ...' if len(absent) > 5 else ''})")
    return rows


def rows(recipe, model, users: np.ndarray, request: PredictRequest) -> dict[str, np.ndarray]:
    """Top-K rows of `users`, a batch of eval_batch_size at a time."""
    h, maxlen = recipe.histories, recipe.data_cfg.maxlen
    device = next(model.parameters()).device
    batch = recipe.train_cfg.eval_batch_size or recipe.train_cfg.batch_size
    out: dict[str, list] = dict(user=[], rank=[], item=[], score=[])
    for start in range(0, len(users), batch):
        chunk = users[start:start + batch]
        seq = torch.from_numpy(np.stack([D.left_pad(h.seqs[u], maxlen) for u in chunk])).to(device)
        time = torch.from_numpy(np.stack([D.left_pad(h.times[u], maxlen) for u in chunk])).to(device)
        seen = None
        if not request.keep_seen:
            seen = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(np.unique(h.seqs[u])) for u in chunk],
                                                   batch_first=True).to(device)
        scores = recipe.ranked_scores(model, seq, time, seen)[:, 1:]          # items 1..N
        values, index = (as_numpy(t) for t in top_k(scores, request.top_k))
        keep = np.isfinite(values)                                          # fewer unseen items than K
        k = values.shape[1]
        out["user"].append(np.repeat(h.user_ids[chunk], k)[keep.ravel()])
        out["rank"].append(np.tile(np.arange(1, k + 1), len(chunk))[keep.ravel()])
        out["item"].append(recipe.data.item_ids[index.ravel()][keep.ravel()])
        out["score"].append(values.ravel()[keep.ravel()].astype(np.float32))
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}

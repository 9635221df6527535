"""KGAT's predictions (`trainer predict`): each user's top-K items in the data's own ids, scored as the evaluation
scores them (the propagated embeddings, user . item), the user's train, validation and test items left out.

    python -m trainer predict --checkpoint runs/kgat --out top20.csv --top-k 20 [--users ids.txt]
        [--unknown-users skip|popular]

Columns: user, rank (1 = best), item, score. Ties go to the lower item id. KGAT scores the users it was trained on
(each has an embedding of its own): a listed user the checkpoint never saw is skipped (counted in one line) or, with
--unknown-users popular, given the K items most often in the training interactions (score: that count).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from trainer.engine.predict import PredictRequest, as_numpy, top_k
from trainer.engine.predict_parts import PredictError

log = logging.getLogger(__name__)


def _original(maps: dict | None, kind: str, ids: np.ndarray) -> np.ndarray:
    """The data's own ids of internal ids (data.remap_ids), else the ids themselves."""
    return np.asarray(maps[kind])[ids] if maps and kind in maps else ids


def units(recipe, request: PredictRequest) -> np.ndarray:
    """User rows to predict for; -(j + 1) marks the j-th listed user the checkpoint never saw (popular only)."""
    if request.data:
        raise PredictError("kgat: --data does not apply: KGAT scores the users it was trained on (their embeddings "
                           "are the checkpoint's); list some of them with --users")
    data = recipe.data
    everyone = np.arange(data.n_users)
    if not request.users:
        return everyone
    listed = [line.strip() for line in Path(request.users).read_text().splitlines() if line.strip()]
    own = _original(data.id_maps, "user", everyone)
    lookup = {str(u): row for row, u in enumerate(own.tolist())}
    rows = np.array([lookup.get(u, -1) for u in listed], dtype=np.int64)
    unknown = [u for u, r in zip(listed, rows) if r < 0]
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        if request.unknown_users == "skip":
            log.info("--users %s: %d of %d users the checkpoint never saw: skipped (%s)", request.users,
                     len(unknown), len(listed), shown)
            return rows[rows >= 0]
        log.info("--users %s: %d of %d users the checkpoint never saw: given the most popular items (%s)",
                 request.users, len(unknown), len(listed), shown)
        recipe.unknown_users = np.array(unknown)
        rows[rows < 0] = -1 - np.arange(len(unknown))
    return rows


def _seen(data) -> list[np.ndarray]:
    splits = [s for s in (data.train, data.val, data.test) if s is not None]
    return [np.unique(np.concatenate([np.asarray(s[u]) for s in splits])) for u in range(data.n_users)]


def rows(recipe, model, users: np.ndarray, request: PredictRequest) -> dict[str, np.ndarray]:
    data = recipe.data
    if getattr(recipe, "predict_emb", None) is None:           # once per process: the propagated embeddings
        recipe.predict_emb = model.propagate()
        recipe.predict_seen = None if request.keep_seen else _seen(data)
        recipe.popular = np.bincount(data.pairs("train")[1], minlength=data.n_items)
    emb = recipe.predict_emb
    out: dict[str, list] = dict(user=[], rank=[], item=[], score=[])
    known = users[users >= 0]
    batch = recipe.train_cfg.eval_batch_size or 1024
    for start in range(0, len(known), batch):
        chunk = known[start:start + batch]
        scores = recipe.user_scores(emb, torch.from_numpy(chunk).to(emb.device))
        if recipe.predict_seen is not None:
            rows_of = np.repeat(np.arange(len(chunk)), [len(recipe.predict_seen[u]) for u in chunk])
            items = np.concatenate([recipe.predict_seen[u] for u in chunk])
            scores[torch.from_numpy(rows_of), torch.from_numpy(items).long()] = float("-inf")
        values, index = (as_numpy(t) for t in top_k(scores, request.top_k))
        keep = np.isfinite(values).ravel()
        k = values.shape[1]
        out["user"].append(np.repeat(_original(data.id_maps, "user", chunk), k)[keep])
        out["rank"].append(np.tile(np.arange(1, k + 1), len(chunk))[keep])
        out["item"].append(_original(data.id_maps, "item", index.ravel())[keep])
        out["score"].append(values.ravel()[keep].astype(np.float32))
    order = np.argsort(-recipe.popular, kind="stable")[:request.top_k]     # --unknown-users popular
    for unit in users[users < 0]:
        out["user"].append(np.array([recipe.unknown_users[-1 - unit]] * len(order)))
        out["rank"].append(np.arange(1, len(order) + 1))
        out["item"].append(_original(data.id_maps, "item", order))
        out["score"].append(recipe.popular[order].astype(np.float32))
    return _joined(out)


def _joined(out: dict[str, list]) -> dict[str, np.ndarray]:
    """The columns; user ids of known (int) and unknown (text) users together as text."""
    users = out["user"]
    if users and len({u.dtype.kind for u in users}) > 1:
        out["user"] = [u.astype(str) for u in users]
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}

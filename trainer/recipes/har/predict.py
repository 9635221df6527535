"""HAR's predictions (`trainer predict`): a label and the class probabilities of every window of new recordings,
read as training reads them (UCI HAR folders, UEA `.ts` files or folders, `.npz`/`.pt` arrays; labels optional:
`@classLabel false` in a `.ts` file), standardised with the checkpoint's training statistics and padded or resampled
to its window length.

    python -m trainer predict --checkpoint runs/har --out labels.csv --data new_recordings.ts

Columns: split (the file's split: train, test, ...; a single file is `train`), case (its index there, from 0),
label (the most probable class; ties: the first class), p_<class> for every class, and true_label where the file
has labels. Without --data: the checkpoint's own data.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from trainer.engine.predict import PredictRequest
from trainer.engine.predict_parts import PredictError
from trainer.recipes.har.prepare import read_splits_cached, to_windows


@dataclasses.dataclass
class Cases:
    """Every window to label, all splits one after the other."""

    x: torch.Tensor
    lengths: torch.Tensor
    split: np.ndarray
    case: np.ndarray
    true: np.ndarray | None          # class names where every file had labels


def cases(recipe, request: PredictRequest) -> Cases:
    cfg = recipe.data_cfg
    raw, source = read_splits_cached(dataclasses.replace(cfg, path=request.data) if request.data else cfg,
                                     getattr(recipe.dist, "local_rank", 0))
    data, names = recipe.data, recipe.class_names
    parts = []
    for split, s in raw.items():
        if not len(s):
            continue
        if s.channels != data.channels:
            raise PredictError(f"{source}: the {split} split has {s.channels} channels; the checkpoint was trained "
                               f"on {data.channels}")
        if len(s.labels) and s.class_names and s.class_names != names:
            raise PredictError(f"{source}: its classes {s.class_names} are not the checkpoint's {names}")
        windows = to_windows(dataclasses.replace(s, labels=np.zeros(len(s), np.int64)), data.mean, data.std,
                             data.length, cfg.length_mode)
        true = np.asarray(names, dtype=object)[s.labels] if len(s.labels) == len(s) else None
        parts.append((split, windows, true))
    if not parts:
        raise PredictError(f"{source}: no case to label")
    every_label = all(t is not None for _, _, t in parts)
    return Cases(torch.cat([w.x for _, w, _ in parts]), torch.cat([w.lengths for _, w, _ in parts]),
                 np.concatenate([[split] * len(w) for split, w, _ in parts]),
                 np.concatenate([np.arange(len(w)) for _, w, _ in parts]),
                 np.concatenate([t for _, _, t in parts]) if every_label else None)


def units(recipe, request: PredictRequest) -> np.ndarray:
    recipe.predict_cases = cases(recipe, request)
    return np.arange(len(recipe.predict_cases.case))


def rows(recipe, model, units: np.ndarray, request: PredictRequest) -> dict[str, np.ndarray]:
    c, names = recipe.predict_cases, recipe.class_names
    device = next(model.parameters()).device
    batch = recipe.train_cfg.eval_batch_size or recipe.train_cfg.batch_size
    probs = []
    for start in range(0, len(units), batch):
        pick = torch.from_numpy(units[start:start + batch])
        logits = recipe.logits(model, (c.x[pick].to(device), c.lengths[pick].to(device), None))
        probs.append(torch.softmax(logits.float(), 1).cpu().numpy())
    p = np.concatenate(probs) if probs else np.zeros((0, len(names)), np.float32)
    out = dict(split=c.split[units], case=c.case[units], label=np.asarray(names, dtype=object)[p.argmax(1)])
    if c.true is not None:
        out["true_label"] = c.true[units]
    out.update({f"p_{name}": p[:, k] for k, name in enumerate(names)})
    return out

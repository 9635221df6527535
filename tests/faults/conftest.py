"""What the data-change and refusal tests share: a small u.data writer and one SASRec run trained on it (made
once per session; the tests copy it before they change anything)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.inprocess import cli

ARGS = ("--recipe", "sasrec", "data.maxlen=20", "model.width=16", "--batch-size", "32", "log.tensorboard=false")


def write_udata(path, seed=0, users=60, items=80, per_user=25):
    """A small MovieLens-format u.data (user, item, rating, time; tab-separated): every user and item present."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, users + 1):
        picked = rng.choice(np.arange(1, items + 1), per_user, replace=False)
        rows += [(u, i, int(rng.integers(1, 5)), 880000000 + 1000 * u + k) for k, i in enumerate(picked)]
    seen = {i for _, i, _, _ in rows}
    rows += [(1, i, 3, 889000000 + i) for i in range(1, items + 1) if i not in seen]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """ROOT/data/u.data and ROOT/run, one epoch of SASRec on it (never changed in place)."""
    root = tmp_path_factory.mktemp("udata-run")
    write_udata(root / "data" / "u.data")
    cli("train", *ARGS, f"data.path={root / 'data'}", "--epochs", "1", "--run-dir", str(root / "run"))
    return root

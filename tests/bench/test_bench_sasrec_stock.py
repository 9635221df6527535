"""bench/sasrec_stock.py: the stock baseline is the reference's model (shapes, causal, the loss over real
positions), its sampler follows the reference's, and a 1-epoch smoke run writes a consistent report."""
import json
import subprocess

import numpy as np
import pytest
import torch

from bench.sasrec_stock import StockSASRec, stock_batches
from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit
from trainer.recipes.sasrec import data as D

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_stock_model_is_causal_and_ignores_later_items():
    torch.manual_seed(0)
    model = StockSASRec(num_items=30, maxlen=12, d=8, depth=2, heads=1, p=0.0).eval()
    seq = torch.randint(1, 31, (3, 12))
    changed = seq.clone()
    changed[:, 8:] = torch.randint(1, 31, (3, 4))
    a, b = model.features(seq), model.features(changed)
    assert a.shape == (3, 12, 8)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)          # position t sees items <= t only
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_stock_sampler_draws_the_references_batches():
    inter = D.synthesize(users=50, items=40, mean_len=15, seed=1)
    split = D.Split(D.build_sequences(inter))
    batches = stock_batches(split, np.random.default_rng(0), maxlen=10, batch_size=16)
    eligible = sum(len(split.train(u)) >= 2 for u in range(split.data.num_users))
    assert len(batches) == eligible // 16
    for seq, pos, neg in batches:
        assert seq.shape == pos.shape == neg.shape == (16, 10)
        assert torch.equal(seq[:, 1:][pos[:, :-1] != 0], pos[:, :-1][pos[:, :-1] != 0])   # pos = next item
        assert ((neg == 0) == (pos == 0)).all() and ((neg >= 0) & (neg <= 40)).all()


def test_stock_bench_smoke(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.sasrec_stock", "--data", "", "--epochs", "1", "--out", str(tmp_path),
                           "--width", "16", "--maxlen", "40", "--batch", "64"],      # both models take the shape flags
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sasrec_stock.json").read_text())
    assert len(report["ours_epoch_s"]) == len(report["stock_epoch_s"]) == 1
    assert abs(report["ratio_median"] - report["ours_epoch_s"][0] / report["stock_epoch_s"][0]) < 0.01
    assert report["stock_batches"] == 943 // 64 and report["our_batches"] == -(-943 // 64)
    assert {k: report["settings"][k] for k in ("width", "maxlen", "batch_size", "depth")} == \
        dict(width=16, maxlen=40, batch_size=64, depth=2)                   # depth: SETTINGS', not given
    assert (tmp_path / "sasrec_stock.png").stat().st_size > 10_000
    assert "ours / stock" in proc.stdout

"""Issue 71 point 1 (shared negatives: `loss.shared_negatives=sequence|batch|in_batch`, uniform or by popularity,
logQ correction) and point 6: the losses against a plain per-position loop on tiny data (values and gradients),
logQ's importance weights unbiased for the softmax's normaliser (a sampling test), the draws of the loader and
of the GPU-shaped path the same bits, settings that would be ignored refused, and a resume bitwise under each."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_bitwise_equal, weights
from tests.inprocess import cli
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqDataConfig, SeqLossConfig
from trainer.recipes.sasrec.device import DeviceSequences
from trainer.recipes.sasrec.losses import real_shared_logits, shared_logits
from trainer.recipes.sasrec.negatives import Sharing, log_q
from trainer.recipes.sasrec.recipe import sequence_loss


def loop_reference(h, weight, pos, neg, seen, kind, beta, lq):
    """One position at a time: the negatives that count (not seen, not the target), logQ-shifted logits."""
    terms, pos_terms, neg_terms, n_neg = [], [], [], 0
    for b in range(pos.shape[0]):
        for t in range(pos.shape[1]):
            if pos[b, t] == 0:
                continue
            p = int(pos[b, t])
            s_pos = h[b, t] @ weight[p] - (lq[p] if lq is not None else 0)
            s_neg = [h[b, t] @ weight[k] - (lq[k] if lq is not None else 0)
                     for j, k in enumerate(neg[b].tolist()) if not seen[b, j] and k != p]
            if kind == "sampled_softmax":
                terms.append(torch.logsumexp(torch.stack([s_pos, *s_neg]), 0) - s_pos)
            else:
                pos_terms.append(F.softplus(-s_pos) * (beta if kind == "gbce" else 1.0))
                neg_terms += [F.softplus(s) for s in s_neg]
                n_neg += len(s_neg)
    if kind == "sampled_softmax":
        return torch.stack(terms).mean()
    if kind == "gbce":
        return (torch.stack(pos_terms).sum() + torch.stack(neg_terms).sum()) / (len(pos_terms) + n_neg)
    return torch.stack(pos_terms).mean() + torch.stack(neg_terms).sum() / n_neg


@pytest.mark.parametrize("mode", ["sequence", "batch"])
@pytest.mark.parametrize("kind", ["sampled_softmax", "bce", "gbce"])
def test_the_shared_losses_are_the_per_position_loop(mode, kind):
    torch.manual_seed(0)
    items, b, t, k = 12, 3, 5, 6
    h = torch.randn(b, t, 4, requires_grad=True)
    weight = torch.randn(items + 1, 4, requires_grad=True)
    pos = torch.tensor([[0, 0, 3, 4, 5], [0, 1, 2, 3, 4], [7, 8, 9, 1, 2]])
    neg = torch.randint(1, items + 1, (b, k))
    if mode == "batch":
        neg = neg[:1].expand(b, k)
    neg = neg.clone()
    neg[1, 0] = 3                                          # a position's own target among the negatives
    seen = torch.rand(b, k) < 0.3
    lq = torch.log(torch.rand(items + 1) + 0.1) if kind == "sampled_softmax" else None
    beta = 0.4
    pos_logits, neg_logits, neg_valid = shared_logits(h, weight, pos, neg, seen, mode, lq)
    ours = sequence_loss(pos_logits, neg_logits, pos, kind, beta, neg_valid)
    ours.backward()
    got = (h.grad.clone(), weight.grad.clone())
    h.grad = weight.grad = None
    ref = loop_reference(h, weight, pos, neg, seen, kind, beta, lq)
    ref.backward()
    assert torch.allclose(ours, ref, atol=1e-5), (float(ours), float(ref))
    assert torch.allclose(got[0], h.grad, atol=1e-5) and torch.allclose(got[1], weight.grad, atol=1e-5)


@pytest.mark.parametrize("mode", ["sequence", "batch", "in_batch"])
@pytest.mark.parametrize("kind", ["sampled_softmax", "bce", "gbce"])
def test_the_cpu_paths_real_positions_give_the_padded_forms_loss(mode, kind):
    """The CPU path scores only each length bucket's real positions (real_shared_logits): the same loss and
    gradients as the padded form the GPU-shaped step keeps, on rows of very different lengths."""
    torch.manual_seed(1)
    items, b, t, k = 40, 10, 12, 7
    lengths = torch.tensor([12, 1, 3, 2, 11, 5, 1, 7, 2, 4])
    seq = torch.randint(1, items + 1, (b, t)) * (torch.arange(t) >= t - lengths[:, None])
    pos = torch.randint(1, items + 1, (b, t)) * (seq != 0)
    neg = torch.randint(1, items + 1, (b, k))
    if mode != "sequence":
        neg = neg[:1].expand(b, k).clone()
    seen = torch.rand(b, k) < 0.3
    lq = torch.log(torch.rand(items + 1) + 0.1) if kind == "sampled_softmax" else None
    h = torch.randn(b, t, 4, requires_grad=True)
    weight = torch.randn(items + 1, 4, requires_grad=True)
    losses, grads = [], []
    for padded in (True, False):
        if padded:
            logits, target = shared_logits(h, weight, pos, neg, seen, mode, lq), pos
        else:
            *logits, target = real_shared_logits(h, weight, seq, pos, neg, seen, mode, lq, buckets=3)
            assert logits[1].shape == (int(lengths.sum()), k)              # the real positions only
        losses.append(sequence_loss(*logits[:2], target, kind, 0.4, logits[2]))
        grads.append(torch.autograd.grad(losses[-1], (h, weight)))
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    for a, c in zip(*grads):
        assert torch.allclose(a, c, atol=1e-6)


def _split(items=60):
    data = D.load(SeqDataConfig(synthetic_users=64, synthetic_items=items, synthetic_mean_len=15))
    return D.Split(data)


def test_logq_weights_make_popularity_samples_an_unbiased_estimate_of_the_normaliser():
    """sum_j exp(s_j) over the catalogue = E[exp(s_k - log q_k)] for k drawn by popularity: the sampled softmax's
    denominator, corrected by log q, estimates the full one (Bengio & Senecal; Yi et al.). Uncorrected, the popular
    items' scores are counted by how often they are drawn: far off."""
    split = _split()
    counts = D.popularity_scores(split)
    plan = Sharing.of(SeqLossConfig(shared_negatives="sequence", negative_distribution="popularity",
                                    exclude_history=False), counts)
    draws = np.concatenate([plan.draw(3, epoch, np.arange(64), 50, split.data.num_items, [], np.zeros((64, 1)))[0]
                            for epoch in range(40)]).ravel()                        # 128,000 draws
    assert draws.min() >= 1 and counts[draws].min() > 0                        # never an item without counts
    freq = np.bincount(draws, minlength=len(counts))[1:] / len(draws)
    share = counts[1:] / counts[1:].sum()
    assert np.abs(freq - share).max() < 0.01, np.abs(freq - share).max()
    s = np.random.default_rng(0).normal(0, 1.5, len(counts))
    truth = np.exp(s[1:][counts[1:] > 0]).sum()
    corrected = np.exp(s[draws] - log_q(counts)[draws]).mean()
    uncorrected = np.exp(s[draws]).mean() * (counts[1:] > 0).sum()
    assert abs(corrected / truth - 1) < 0.03, (corrected, truth)
    assert abs(uncorrected / truth - 1) > 3 * abs(corrected / truth - 1), (uncorrected, corrected, truth)


CASES = [("sequence", "uniform", True), ("sequence", "popularity", True), ("sequence", "popularity", False),
         ("batch", "uniform", True), ("batch", "popularity", False), ("in_batch", "uniform", True)]


@pytest.mark.parametrize("mode,distribution,exclude", CASES)
def test_the_loader_and_the_gpu_shaped_path_draw_the_same_negatives(mode, distribution, exclude):
    split = _split()
    plan = Sharing.of(SeqLossConfig(shared_negatives=mode, negative_distribution=distribution,
                                    exclude_history=exclude), D.popularity_scores(split))
    train = D.TrainSequences(split, 20, 7, seed=5, sharing=plan)
    train.epoch = 2
    rows = list(range(0, 64, 2))
    batch = D.collate(train.__getitems__(rows))
    on_device = DeviceSequences(train, torch.device("cpu")).gather(torch.tensor(rows), epoch=2)
    assert batch.keys() == on_device.keys() and all(torch.equal(batch[k], on_device[k]) for k in batch)
    neg, seen = batch["neg"], batch["neg_seen"]
    for i, u in enumerate(train.users[rows]):
        history = set(split.train(u).tolist())
        assert seen[i].tolist() == ([x in history for x in neg[i].tolist()] if exclude else [False] * neg.shape[1])
    if mode != "sequence":                                 # one row for the whole batch, whatever its order
        assert (neg == neg[:1]).all()
        reverse = D.collate(train.__getitems__(rows[::-1]))["neg"][0]
        assert torch.equal(reverse, neg[0].flip(0) if mode == "in_batch" else neg[0])
    if mode == "in_batch":                                 # each sequence lends one of its own targets
        assert neg.shape[1] == len(rows) and all(int(neg[0, i]) in batch["pos"][i].tolist() for i in range(len(rows)))
    train.epoch = 3
    assert not torch.equal(D.collate(train.__getitems__(rows))["neg"], neg)    # a new epoch, new draws


def test_the_per_position_negatives_may_keep_the_history():
    split = _split(items=30)
    keep = D.TrainSequences(split, 20, 3, seed=5, sharing=Sharing(exclude_history=False))
    default = D.TrainSequences(split, 20, 3, seed=5)
    rows = list(range(16))
    kept, excluded = (D.collate(t.__getitems__(rows))["neg"] for t in (keep, default))
    hits = [int(n) in set(split.train(u).tolist()) for i, u in enumerate(keep.users[rows]) for n in kept[i].ravel()
            if n != 0]
    assert any(hits) and not torch.equal(kept, excluded)
    on_device = DeviceSequences(keep, torch.device("cpu")).gather(torch.tensor(rows), epoch=0)
    assert torch.equal(on_device["neg"], kept)


RUN = ("train", "--recipe", "sasrec", "log.tensorboard=false", "data.synthetic_users=120", "data.synthetic_items=200",
       "model.mhc=false", "model.time=false")


@pytest.mark.long        # six launches of the trainer: make test-fast leaves it out
@pytest.mark.parametrize("overrides", [
    ("loss.kind=sampled_softmax", "loss.shared_negatives=in_batch"),
    ("loss.kind=gbce", "loss.shared_negatives=sequence", "loss.negative_distribution=popularity",
     "data.train_negatives=16"),
    ("loss.kind=bce", "loss.shared_negatives=batch", "loss.exclude_history=false", "data.train_negatives=8"),
], ids=["softmax-in_batch", "gbce-sequence-popularity", "bce-batch"])
def test_a_resume_under_each_shared_loss_ends_bitwise_equal(tmp_path, overrides):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cli(*RUN, *overrides, "--epochs", "2", "ckpt.every_steps=3", "ckpt.keep_last=0", "--run-dir", str(whole))
    (parts / "checkpoints").mkdir(parents=True)
    shutil.copy(whole / "checkpoints" / "step-00000003.pt", parts / "checkpoints")   # mid-epoch
    cli(*RUN, *overrides, "--epochs", "2", "--resume", "auto", "--run-dir", str(parts))
    assert_bitwise_equal(weights(parts), weights(whole))


@pytest.mark.parametrize("overrides,message", [
    (("loss.kind=ce", "loss.shared_negatives=sequence"), "loss.shared_negatives=sequence would be ignored"),
    (("loss.negative_distribution=popularity",), "set loss.shared_negatives=sequence or batch"),
    (("loss.gbce_t=0.5",), "loss.gbce_t=0.5 would be ignored: it counts only with loss.kind=gbce"),
])
def test_settings_that_would_be_ignored_are_refused(tmp_path, overrides, message):
    proc = cli(*RUN, *overrides, "--epochs", "1", "--run-dir", str(tmp_path / "r"), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()                      # refused before the run directory was made

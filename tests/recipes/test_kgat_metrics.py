"""Top-K metrics against a brute-force per-user computation (including users with fewer test items than K)."""
import math

import pytest
import torch

from trainer.recipes.kgat.metrics import finalize, topk_sums


def brute(scores, test, ks, variant):
    out = {f"{m}@{k}": 0.0 for m in ("recall", "precision", "ndcg", "hr") for k in ks}
    users = 0
    for s, t in zip(scores.tolist(), test):
        if not t:
            continue
        users += 1
        ranked = sorted(range(len(s)), key=lambda i: -s[i])
        for k in ks:
            top = ranked[:k]
            rel = [1 if i in t else 0 for i in top]
            n_hit = sum(rel)
            dcg = sum(r / math.log2(j + 2) for j, r in enumerate(rel))
            n_ideal = min(len(t), k) if variant == "standard" else n_hit
            idcg = sum(1 / math.log2(j + 2) for j in range(n_ideal)) or 1.0
            out[f"recall@{k}"] += n_hit / len(t)
            out[f"precision@{k}"] += n_hit / k
            out[f"ndcg@{k}"] += dcg / idcg
            out[f"hr@{k}"] += n_hit > 0
    return {k: v / users for k, v in out.items()}, users


@pytest.mark.parametrize("variant", ["standard", "original"])
def test_topk_metrics_equal_brute_force(variant):
    g = torch.Generator().manual_seed(0)
    n_users, n_items, ks = 40, 150, (5, 20, 100)
    scores = torch.rand(n_users, n_items, generator=g, dtype=torch.float64)
    test = []
    for u in range(n_users):
        size = [0, 1, 3, 30][u % 4]                       # none, fewer than K, and more than K test items
        test.append(set(torch.randperm(n_items, generator=g)[:size].tolist()))
    mask = torch.zeros(n_users, n_items, dtype=torch.bool)
    for u, t in enumerate(test):
        mask[u, list(t)] = True
    got = finalize(topk_sums(scores, mask, ks, variant))
    ref, users = brute(scores, test, ks, variant)
    assert got["users"] == users == 30
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_original_ndcg_is_inflated_and_excluded_items_never_rank():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False, False, True, True]])
    std = finalize(topk_sums(scores, mask, (2,), "standard"))
    orig = finalize(topk_sums(scores, mask, (2,), "original"))
    assert std["ndcg@2"] == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))
    assert orig["ndcg@2"] == pytest.approx(1 / math.log2(3))          # ideal from the single hit found
    scores[0, 0] = float("-inf")                                       # a training item: excluded
    assert finalize(topk_sums(scores, mask, (1,)))["hr@1"] == 1.0
    with pytest.raises(ValueError, match="standard or original"):
        topk_sums(scores, mask, (1,), "paper")

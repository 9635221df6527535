"""Full-ranking top-K metrics (Recall, Precision, NDCG, HitRatio) as sums over users, for sharded evaluation.

NDCG: "standard" divides by the ideal DCG of min(|test|, K) relevant items. "original" reproduces the
KGAT code, whose ideal DCG comes from the sorted hit vector of the top K (only the items found), so a
user with one hit at rank 10 out of 50 test items scores 1.0 there: it inflates NDCG, and is only
for comparing with the paper's tables.
"""
from __future__ import annotations

import torch

from trainer.recipes.kgat.config import KS


def _discounts(n: int, device) -> torch.Tensor:
    return 1.0 / torch.log2(torch.arange(n, device=device, dtype=torch.float64) + 2)


def topk_sums(scores: torch.Tensor, test_mask: torch.Tensor, ks=KS, ndcg: str = "standard") -> dict[str, torch.Tensor]:
    """scores (B, I) with excluded items at -inf, test_mask (B, I) bool -> sums over users with test items."""
    keep = test_mask.any(1)
    scores, test_mask = scores[keep], test_mask[keep]
    top = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices
    return sums_from_hits(test_mask.gather(1, top), test_mask.sum(1), ks, ndcg)


def sums_from_hits(hits: torch.Tensor, n_test: torch.Tensor, ks=KS, ndcg: str = "standard") -> dict[str, torch.Tensor]:
    """hits (B, kmax) bool: is the item ranked j-th relevant; n_test (B,) > 0 relevant items per user."""
    if ndcg not in ("standard", "original"):
        raise ValueError(f"eval ndcg variant {ndcg!r}: standard or original")
    hits, n_test = hits.double(), n_test.double()
    kmax = hits.shape[1]
    disc = _discounts(kmax, hits.device)
    ideal = torch.cumsum(disc, 0)
    out = {"count": torch.tensor(float(len(n_test)), dtype=torch.float64)}
    cum_hits, cum_dcg = hits.cumsum(1), (hits * disc).cumsum(1)
    for k in ks:
        kk = min(k, kmax)
        n_hit, dcg = cum_hits[:, kk - 1], cum_dcg[:, kk - 1]
        if ndcg == "standard":
            idcg = ideal[(n_test.clamp(max=kk) - 1).long()]
        else:
            idcg = torch.where(n_hit > 0, ideal[(n_hit.clamp(min=1) - 1).long()], torch.ones_like(n_hit))
        out[f"recall@{k}"] = (n_hit / n_test).sum()
        out[f"precision@{k}"] = (n_hit / k).sum()
        out[f"ndcg@{k}"] = (dcg / idcg).sum()
        out[f"hr@{k}"] = (n_hit > 0).double().sum()
    return out


def finalize(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over users from (all-reduced) sums."""
    n = max(float(totals["count"]), 1.0)
    out = {k: float(v) / n for k, v in totals.items() if k != "count"}
    out["users"] = int(totals["count"])
    return out


def metric_names(ks, ndcg: str = "standard") -> set[str]:
    """The names finalize() gives for these cut-offs (the evaluation's own functions, on one empty user)."""
    return set(finalize(sums_from_hits(torch.zeros((1, max(ks)), dtype=torch.bool), torch.ones(1), ks, ndcg)))

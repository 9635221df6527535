"""Full-ranking top-K metrics (Recall, Precision, NDCG, HitRatio) as sums over users, for sharded evaluation.

NDCG: "standard" divides by the ideal DCG of min(|test|, K) relevant items. "original" reproduces the
KGAT code, whose ideal DCG comes from the sorted hit vector of the top K (only the items found), so a
user with one hit at rank 10 out of 50 test items scores 1.0 there: it inflates NDCG, and is only
for comparing with the paper's tables.
"""
from __future__ import annotations

import torch

KS = (20, 40, 60, 80, 100)


def _discounts(n: int, device) -> torch.Tensor:
    return 1.0 / torch.log2(torch.arange(n, device=device, dtype=torch.float64) + 2)


def topk_sums(scores: torch.Tensor, test_mask: torch.Tensor, ks=KS, ndcg: str = "standard") -> dict[str, torch.Tensor]:
    """scores (B, I) with excluded items at -inf, test_mask (B, I) bool -> sums over users with test items."""
    if ndcg not in ("standard", "original"):
        raise ValueError(f"eval ndcg variant {ndcg!r}: standard or original")
    keep = test_mask.any(1)
    scores, test_mask = scores[keep], test_mask[keep]
    kmax = min(max(ks), scores.shape[1])
    top = scores.topk(kmax, dim=1).indices
    hits = test_mask.gather(1, top).double()
    n_test = test_mask.sum(1).double()
    disc = _discounts(kmax, scores.device)
    ideal = torch.cumsum(disc, 0)
    out = {"count": keep.sum().double()}
    for k in ks:
        kk = min(k, kmax)
        h = hits[:, :kk]
        n_hit = h.sum(1)
        dcg = (h * disc[:kk]).sum(1)
        if ndcg == "standard":
            idcg = ideal[(torch.minimum(n_test, torch.tensor(float(kk), device=n_test.device)) - 1).long()]
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

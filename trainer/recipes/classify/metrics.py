"""Classification metrics from a confusion matrix: accuracy, macro-F1, per-class F1.

    cm = confusion_matrix(pred, target, num_classes=6)     # additive: summed over batches and ranks
    classification_metrics(cm, ["walk", "run", ...])       # {"accuracy": ..., "macro_f1": ..., "f1/walk": ...}
"""
from __future__ import annotations

import torch


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """C x C counts (rows: true class, columns: predicted), float64 so it can be all-reduced."""
    idx = target.long() * num_classes + pred.long()
    counts = torch.bincount(idx.flatten().cpu(), minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).to(torch.float64)


def classification_metrics(cm: torch.Tensor, class_names: list[str] | None = None) -> dict[str, float | None]:
    """accuracy, macro_f1 and f1/<class> from a confusion matrix. macro_f1 averages over the classes present in
    the split (some true case); a class without cases has no F1 (None: absent, not 0)."""
    cm = cm.to(torch.float64)
    tp = cm.diag()
    precision = tp / cm.sum(0).clamp(min=1e-12)
    recall = tp / cm.sum(1).clamp(min=1e-12)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                     torch.zeros_like(tp))
    present = cm.sum(1) > 0
    names = class_names or [str(i) for i in range(cm.shape[0])]
    out = dict(accuracy=float(tp.sum() / cm.sum().clamp(min=1e-12)),
               macro_f1=float(f1[present].mean()) if present.any() else 0.0)
    out.update({f"f1/{n}": float(v) if here else None for n, v, here in zip(names, f1, present.tolist())})
    return out

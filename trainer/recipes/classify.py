"""What every classification recipe shares: additive evaluation statistics (confusion matrix, loss sum),
accuracy / macro-F1 / per-class F1, and the confusion-matrix PNG of each evaluation.

    class MyRecipe(ClassifierRecipe):
        def logits(self, model, batch): ...      # and class_names, set in build_datasets
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.distributed import runtime
from trainer.engine.metrics import classification_metrics, confusion_matrix
from trainer.engine.plots import confusion_png
from trainer.engine.recipe import Recipe


class ClassifierRecipe(Recipe):
    """Batches end with the class index; best checkpoint by validation macro-F1 (ties: lower loss)."""

    # BatchNorm's running statistics are read only in eval mode, and rank 0's are the same whether or not they
    # are sent before every step (it is their source): sending them once, before evaluation, makes every
    # rank's shard scored with rank 0's, as before, without a collective (and a wait) at each forward.
    broadcast_buffers = False
    buffers_before_eval = True

    primary_metric = ("macro_f1", "max")
    tie_break_metric = ("loss", "min")    # small validation sets saturate macro-F1 at 1.0
    class_names: list[str] = []

    def logits(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """[B, classes] scores of a batch."""
        raise NotImplementedError

    def counted(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """logits, after adding the batch to the epoch's training accuracy (the seeds log it): the hits are
        summed on the device and read once, at the epoch's end (a read per step made the host wait for it)."""
        hits = (logits.detach().argmax(1) == y).sum()
        last = getattr(self, "_train_hits", None)
        self._train_hits = hits if last is None else last + hits
        self._train_cases = getattr(self, "_train_cases", 0) + len(y)
        return logits

    def on_epoch_start(self, epoch: int, model: torch.nn.Module) -> None:
        self._train_hits, self._train_cases = None, 0

    def epoch_metrics(self) -> dict[str, float]:
        """Training accuracy of the epoch over every rank (dropout on, as the batches were trained)."""
        hits = getattr(self, "_train_hits", None)
        device = runtime.comm_device(self.dist)
        sums = torch.tensor([0.0, float(getattr(self, "_train_cases", 0))], dtype=torch.float64, device=device)
        if hits is not None:
            sums[0] = hits.to(device, torch.float64)
        correct, total = runtime.all_reduce(sums, self.dist).cpu().tolist()
        return {"accuracy": correct / total} if total else {}

    def eval_step(self, model, batch):
        logits = self.logits(model, batch).float()
        y = batch[-1]
        return {"confusion": confusion_matrix(logits.argmax(1), y, len(self.class_names)),
                "loss_sum": F.cross_entropy(logits.double(), y, reduction="sum")}

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        cm = totals["confusion"]
        n = float(cm.sum())
        out: dict[str, Any] = classification_metrics(cm, self.class_names)
        out.update(loss=float(totals["loss_sum"]) / max(n, 1.0), cases=int(n), confusion_matrix=cm.long().tolist())
        return out

    def after_evaluation(self, split, metrics, run_dir, epoch):
        png = confusion_png(metrics["confusion_matrix"], self.class_names, Path(run_dir) / f"confusion_{split}.png",
                            f"{split} after epoch {epoch}: accuracy {metrics['accuracy']:.4f}, "
                            f"macro-F1 {metrics['macro_f1']:.4f}")
        return [png] if png is not None else []

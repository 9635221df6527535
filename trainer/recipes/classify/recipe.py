"""What every classification recipe shares: additive evaluation statistics (confusion matrix, loss sum),
accuracy / macro-F1 / per-class F1, and the confusion-matrix PNG of each evaluation.

    class MyRecipe(ClassifierRecipe):
        def logits(self, model, batch): ...      # and class_names, set in build_datasets
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.distributed import runtime
from trainer.engine.capabilities import DataProvenance, DDPPolicy, EpochPlan, Evaluation, GPUShapedStep
from trainer.engine.recipe import Recipe
from trainer.recipes.classify.metrics import classification_metrics, confusion_matrix
from trainer.recipes.classify.plots import confusion_png

log = logging.getLogger(__name__)


class ClassifierRecipe(Recipe, EpochPlan, Evaluation, DDPPolicy, DataProvenance, GPUShapedStep):
    """Batches end with the class index; best checkpoint by validation macro-F1 (ties: lower loss)."""

    # BatchNorm's running statistics are read only in eval mode, and rank 0's are the same whether or not they
    # are sent before every step (it is their source): sending them once, before evaluation, makes every
    # rank's shard scored with rank 0's, as before, without a collective (and a wait) at each forward.
    broadcast_buffers = False
    buffers_before_eval = True

    primary_metric = ("macro_f1", "max")
    tie_break_metric = ("loss", "min")    # small validation sets saturate macro-F1 at 1.0
    class_names: list[str] = []

    train_counts: list[int] = []          # training cases per class (note_training_classes)

    def note_training_classes(self, labels: np.ndarray, require_all: bool) -> None:
        """Every rank, in build_datasets: the training cases per class; a class declared but never trained on
        is named (its F1 is 0 and pulls macro-F1 down), or refused with data.require_all_classes=true."""
        self.train_counts = np.bincount(np.asarray(labels), minlength=len(self.class_names)).tolist()
        missing = [n for n, c in zip(self.class_names, self.train_counts) if c == 0]
        if missing and require_all:
            raise ValueError(f"class(es) with no training case: {', '.join(missing)} (of {len(self.class_names)} "
                             f"declared).\nHINT: add cases of them, drop them from the data, or set "
                             f"data.require_all_classes=false to train anyway")
        if missing and self.dist.is_main:
            log.warning("class(es) with no training case: %s: the model cannot learn them, and their F1 of 0 "
                        "pulls macro-F1 down (data.require_all_classes=true refuses this)", ", ".join(missing))

    def data_counts(self) -> dict[str, int]:
        return dict(classes=len(self.class_names), training_cases=sum(getattr(self, "train_counts", [])))

    def logits(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """[B, classes] scores of a batch."""
        raise NotImplementedError

    def counted(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """logits, after noting the batch's hits for the epoch's training accuracy (the seeds log it): they are
        summed on the device (after_step) and read once, at the epoch's end (a read per step made the host wait)."""
        self._step_hits = (logits.detach().argmax(1) == y).sum()
        self._step_cases = len(y)
        return logits

    def after_step(self) -> None:
        # out here, not in counted: under compile.mode=reduce-overhead the hits are a CUDA graph's output, which
        # the next replay overwrites, so the running sum must not be carried into the graph
        hits = getattr(self, "_step_hits", None)
        if hits is None:
            return
        last = getattr(self, "_train_hits", None)
        self._train_hits = hits.clone() if last is None else last + hits
        self._train_cases = getattr(self, "_train_cases", 0) + self._step_cases
        self._step_hits = None

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

    def metric_names(self):
        if not self.class_names:
            return None
        classes = len(self.class_names)
        return set(self.compute_metrics({"confusion": torch.zeros((classes, classes)), "loss_sum": torch.tensor(0.0)}))

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        cm = totals["confusion"]
        n = float(cm.sum())
        out: dict[str, Any] = classification_metrics(cm, self.class_names)
        out.update(loss=float(totals["loss_sum"]) / max(n, 1.0), cases=int(n), confusion_matrix=cm.long().tolist())
        if self.train_counts and 0 in self.train_counts:       # the per-class table says which were never trained
            out["no_training_case"] = [n for n, c in zip(self.class_names, self.train_counts) if c == 0]
        return out

    def after_evaluation(self, split, metrics, run_dir, epoch):
        record = Path(run_dir) / "data.json"                   # the classes' training counts, once per run dir
        if self.train_counts and not record.exists():
            record.write_text(json.dumps(dict(classes=self.class_names, train_cases=self.train_counts,
                                              no_training_case=metrics.get("no_training_case", [])), indent=1) + "\n")
        png = confusion_png(metrics["confusion_matrix"], self.class_names, Path(run_dir) / f"confusion_{split}.png",
                            f"{split} after epoch {epoch}: accuracy {metrics['accuracy']:.4f}, "
                            f"macro-F1 {metrics['macro_f1']:.4f}")
        return [png] if png is not None else []

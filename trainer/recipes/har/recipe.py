"""Human-activity recognition: multichannel windows -> activity, with the seed's channel-fusion modes.

    python -m trainer train --recipe har --config configs/har/basicmotions.yaml data.path=../shared/data/BasicMotions
    torchrun --nproc-per-node 2 -m trainer train --recipe har --config configs/har/uci-har.yaml --mode flatten
    python -m trainer train --recipe har --config configs/har/uci-har.yaml --strategy dp --gpu-ids 0,1
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.engine.metrics import classification_metrics, confusion_matrix
from trainer.engine.plots import confusion_png
from trainer.recipes.base import Recipe
from trainer.recipes.har.model import HARModelConfig, HARNet
from trainer.recipes.har.prepare import HARDataConfig, load

log = logging.getLogger(__name__)


class HARRecipe(Recipe):
    """Cross-entropy (optional label smoothing) over windows; best checkpoint by validation macro-F1."""

    data_config = HARDataConfig
    model_config = HARModelConfig
    primary_metric = ("macro_f1", "max")
    tie_break_metric = ("loss", "min")    # small validation sets saturate macro-F1 at 1.0
    defaults = {"train.amp": "auto", "train.batch_size": 64, "train.epochs": 30, "train.lr": 2e-3,
                "train.weight_decay": 1e-2, "train.warmup_epochs": 1.0}

    def build_datasets(self):
        self.data = load(self.data_cfg, self.seed)
        d = self.data
        sizes = ", ".join(f"{k} {len(v)}" for k, v in d.splits.items())
        log.info("HAR data: %s; %d channels x %d samples, %d classes; %s", d.source, d.channels, d.length,
                 len(d.class_names), sizes)
        counts = np.bincount(d.splits["train"].y.numpy(), minlength=len(d.class_names))
        log.info("training cases per class: %s", ", ".join(f"{n}={c}" for n, c in zip(d.class_names, counts)))
        return d.splits["train"], {k: v for k, v in d.splits.items() if k in ("val", "test")}

    def build_model(self):
        return HARNet(self.model_cfg, self.data.channels, self.data.length, len(self.data.class_names))

    def training_step(self, model, batch):
        x, lengths, y = batch
        logits = model(x, lengths)
        return F.cross_entropy(logits.float(), y, label_smoothing=self.model_cfg.label_smoothing)

    def eval_step(self, model, batch):
        x, lengths, y = batch
        logits = model(x, lengths).float()
        return {"confusion": confusion_matrix(logits.argmax(1), y, len(self.data.class_names)),
                "loss_sum": F.cross_entropy(logits.double(), y, reduction="sum")}

    def compute_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, Any]:
        cm = totals["confusion"]
        n = float(cm.sum())
        out: dict[str, Any] = classification_metrics(cm, self.data.class_names)
        out.update(loss=float(totals["loss_sum"]) / max(n, 1.0), cases=int(n),
                   confusion_matrix=cm.long().tolist())
        return out

    def after_evaluation(self, split, metrics, run_dir, epoch):
        confusion_png(metrics["confusion_matrix"], self.data.class_names, Path(run_dir) / f"confusion_{split}.png",
                      f"{split} after epoch {epoch}: accuracy {metrics['accuracy']:.4f}, "
                      f"macro-F1 {metrics['macro_f1']:.4f}")

"""Human-activity recognition: multichannel windows -> activity, with the seed's channel-fusion modes.

    python -m trainer train --recipe har --config configs/har/basicmotions.yaml data.path=../shared/data/BasicMotions
    torchrun --nproc-per-node 2 -m trainer train --recipe har --config configs/har/uci-har.yaml --mode flatten
    python -m trainer train --recipe har --config configs/har/uci-har.yaml --strategy dp --gpu-ids 0,1
"""
from __future__ import annotations

import logging

import torch.nn.functional as F

from trainer.engine.capabilities import DeviceResident, Prediction
from trainer.engine.loader import TensorBatches, fits_on_device
from trainer.recipes.classify.recipe import ClassifierRecipe
from trainer.recipes.har.model import HARNet
from trainer.recipes.har.prepare import load

log = logging.getLogger(__name__)


class HARRecipe(ClassifierRecipe, DeviceResident, Prediction):
    """Cross-entropy (optional label smoothing) over windows; best checkpoint by validation macro-F1."""


    def build_datasets(self):
        self.data = d = load(self.data_cfg, self.seed, getattr(self.dist, "local_rank", 0))
        self.class_names = d.class_names
        sizes = ", ".join(f"{k} {len(v)}" for k, v in d.splits.items())
        log.info("HAR data: %s; %d channels x %d samples, %d classes; %s", d.source, d.channels, d.length,
                 len(d.class_names), sizes)
        self.note_training_classes(d.splits["train"].y.numpy(), self.data_cfg.require_all_classes)
        log.info("training cases per class: %s", ", ".join(f"{n}={c}" for n, c in zip(d.class_names,
                                                                                    self.train_counts)))
        return d.splits["train"], {k: v for k, v in d.splits.items() if k in ("val", "test")}

    def device_dataset(self):
        """The GPU-shaped step's training set: the windows on the device (a batch is a gather)."""
        if not self.gpu_shaped:
            return None
        train = self.data.splits["train"]
        data = TensorBatches((train.x, train.lengths, train.y), self.dist.torch_device)
        return data if fits_on_device(data.nbytes, self.dist.torch_device) else None

    def build_model(self):
        return HARNet(self.model_cfg, self.data.channels, self.data.length, len(self.data.class_names))

    def logits(self, model, batch):
        x, lengths, _ = batch
        return model(x, lengths)

    def training_step(self, model, batch):
        return F.cross_entropy(self.counted(self.logits(model, batch).float(), batch[2]), batch[2],
                               label_smoothing=self.loss_cfg.label_smoothing)

    predict_unit_name = "windows"

    def predict_units(self, request):
        from trainer.recipes.har import predict
        return predict.units(self, request)

    def predict_rows(self, model, units, request):
        from trainer.recipes.har import predict
        return predict.rows(self, model, units, request)

"""Behaviour classification from videos with per-frame labels: a 3D CNN over clips centred on each
labelled frame, weighted cross-entropy, best checkpoint by validation macro-F1.

    python -m trainer data synth video --out data/synth-video
    python -m trainer train --config configs/video/synthetic.yaml data.path=data/synth-video
    python hpc/submit.py --config configs/video/mouse.yaml --gpus-per-node 3 data.path=data/mouse
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from trainer.distributed import runtime
from trainer.engine.capabilities import Prediction
from trainer.recipes.classify.recipe import ClassifierRecipe
from trainer.recipes.video.clips import prepare, weights_table
from trainer.recipes.video.model import build

log = logging.getLogger(__name__)


class VideoRecipe(ClassifierRecipe, Prediction):
    """Clips arrive as uint8 (4x less to copy); they become floats in [-1, 1] on the device."""


    def build_datasets(self):
        info = self.dist
        self.data = d = prepare(self.data_cfg, self.seed, is_main=info.is_main,
                                share=lambda obj: runtime.broadcast_object(obj, info))
        self.class_names = d.class_names
        self.note_training_classes(np.asarray(d.splits["train"].labels), self.data_cfg.require_all_classes)
        if info.is_main:
            log.info("videos per split: %s", {k: len(v) for k, v in d.videos.items()})
            log.info("\n%s", weights_table(d.class_names, d.splits["train"].labels, d.weights))
        return d.splits["train"], {k: v for k, v in d.splits.items() if k in ("val", "test")}

    def build_model(self):
        model = build(self.model_cfg, self.data.channels, len(self.data.class_names))
        # channels-last on CPUs too: oneDNN's convolutions and the channels-last max-pool run 1.2-1.6x faster
        # per step there (the contiguous max-pool alone was 17% of a step) and read less memory
        return model.to(memory_format=torch.channels_last_3d)

    def inputs(self, clips: torch.Tensor) -> torch.Tensor:
        x = clips.float().mul_(2.0 / 255.0).sub_(1.0)
        return x.contiguous(memory_format=torch.channels_last_3d)

    def logits(self, model, batch):
        return model(self.inputs(batch[0]))

    def before_step(self, batch) -> None:
        self.loss_weight(batch[1].device)       # here, outside compile.mode's graph (see loss_weight)

    def loss_weight(self, device: torch.device) -> torch.Tensor:
        """The class weights on the batch's device, copied there once (a copy per step made a CUDA step wait), in
        before_step: made inside a step compiled with CUDA graphs, they were a graph's output, which the next
        replay overwrote."""
        held = getattr(self, "_loss_weight", None)
        if held is None or held.device != device:
            self._loss_weight = held = self.data.weights.to(device)
        return held

    def training_step(self, model, batch):
        weight = self.loss_weight(batch[1].device)
        return F.cross_entropy(self.counted(self.logits(model, batch).float(), batch[1]), batch[1], weight=weight,
                               label_smoothing=self.loss_cfg.label_smoothing)

    predict_unit_name = "frames"

    def predict_units(self, request):
        from trainer.recipes.video import predict
        return predict.units(self, request)

    def predict_rows(self, model, units, request):
        from trainer.recipes.video import predict
        return predict.rows(self, model, units, request)

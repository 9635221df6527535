"""Optimizer, learning-rate scaling by world size, and warmup + decay schedules."""
from __future__ import annotations

import math
from collections import defaultdict

import torch


def scaled_lr(lr: float, rule: str, world_size: int) -> float:
    """The base lr scaled by world size: none, linear (lr*W) or sqrt (lr*sqrt(W))."""
    factor = {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[rule]
    return lr * factor


def optimizer_spec(train_cfg, lr: float) -> tuple[type[torch.optim.Optimizer], dict]:
    """The configured optimizer class and its keyword arguments at learning rate lr."""
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=lr, momentum=train_cfg.momentum, weight_decay=train_cfg.weight_decay)
    cls = torch.optim.AdamW if train_cfg.optimizer == "adamw" else torch.optim.Adam
    # fused: one kernel per parameter instead of ~10 element-wise passes (the same update; on CPU 6-7x faster
    # on KGAT's embedding tables, where dense Adam over every row dominated the KG phase)
    return cls, dict(lr=lr, betas=tuple(train_cfg.betas), weight_decay=train_cfg.weight_decay, fused=True)


def build_optimizer(params, train_cfg, world_size: int) -> torch.optim.Optimizer:
    """The configured optimizer with the scaled learning rate."""
    cls, kwargs = optimizer_spec(train_cfg, scaled_lr(train_cfg.lr, train_cfg.lr_scaling, world_size))
    return cls(params, **kwargs)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def warmup_steps(train_cfg, steps_per_epoch: int) -> int:
    """Warmup length in optimizer steps: the larger of warmup_steps and warmup_epochs."""
    return max(int(train_cfg.warmup_steps), int(round(train_cfg.warmup_epochs * steps_per_epoch)))


def build_scheduler(optimizer, train_cfg, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over optimizer steps for the whole run."""
    total = steps_per_epoch * train_cfg.epochs
    if train_cfg.max_steps > 0:
        total = min(total, train_cfg.max_steps)
    warm = warmup_steps(train_cfg, steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warm, total, train_cfg.schedule, train_cfg.min_lr_ratio))


def phased(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`base` with one state per phase over the same parameters (KGAT's original code keeps one Adam for
    its CF loss and another for its KG loss); set_phase() picks the state the next step() updates."""

    class Phased(base):
        def __init__(self, params, phases: tuple[str, ...], **kwargs):
            super().__init__(params, **kwargs)
            self.phase = phases[0]
            self._states = {p: self.state if p == self.phase else defaultdict(dict) for p in phases}

        def set_phase(self, phase: str) -> None:
            self._states[self.phase] = self.state
            self.phase, self.state = phase, self._states[phase]

        def state_dict(self):
            current, out = self.phase, {}
            for p in list(self._states):
                self.set_phase(p)
                out[p] = super().state_dict()
            self.set_phase(current)
            return {"phase": current, "phases": out}

        def load_state_dict(self, state_dict):
            for p, sd in state_dict["phases"].items():
                self.set_phase(p)
                super().load_state_dict(sd)
            self.set_phase(state_dict["phase"])

    Phased.__name__ = Phased.__qualname__ = f"Phased{base.__name__}"
    return Phased

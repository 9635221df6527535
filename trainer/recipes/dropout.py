"""Inverted dropout with a cheap mask, shared by the recipes' models (SASRec's attention and FFN, KGAT's
message dropout): torch's dropout draws one random float per element, which on a CPU dominated steps whose
other work is a few element-wise passes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipes import kernels


def keep_mask(x: torch.Tensor, p: float, scale: bool = True) -> tuple[torch.Tensor, float]:
    """Bernoulli(1-p) keep mask from four 15-bit fields of each random int64 word (random_ fills
    [0, 2^63), so the low 60 bits are uniform): a quarter of the RNG draws of torch.rand. p is
    quantised to 1/32768; the keep-scale 1/(1-p) uses the quantised value. The mask is made in x's dtype
    by integer arithmetic (field - threshold + 1 clamped to [0, 1]): a boolean mask cost a conversion at
    every multiply, forward and backward (~7x the multiply itself on CPU). With scale=True the mask holds
    0 or 1/(1-p) and the returned scale is 1."""
    threshold = round(p * 32768)
    if threshold == 0:                  # p < 2^-16: nothing to drop (and field + 1 would overflow int16)
        return torch.ones_like(x), 1.0
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()
    fields = words.view(torch.int16)[:n].bitwise_and(0x7FFF).sub_(threshold - 1).clamp_(0, 1)
    keep, factor = fields.to(x.dtype).view(x.shape), 32768 / (32768 - threshold)
    if scale:
        return keep.mul_(factor), 1.0
    return keep, factor


class _HashDropout(torch.autograd.Function):
    """keep_mask's dropout in one C++ pass (dropout_kernels.inc: a counter-based hash of one seed drawn from torch's
    generator, so torch.manual_seed still fixes it); the backward recomputes the mask from the seed."""

    @staticmethod
    def forward(ctx, x, threshold, factor, ops):
        ctx.seed = int(torch.randint(0, 2**62, (1,)).item())
        ctx.threshold, ctx.factor, ctx.ops = threshold, factor, ops
        return ops.dropout(x.contiguous(), ctx.seed, threshold, factor)

    @staticmethod
    def backward(ctx, grad):
        return ctx.ops.dropout(grad.contiguous(), ctx.seed, ctx.threshold, ctx.factor), None, None, None


def _kernels(x: torch.Tensor):
    """The compiled CPU kernels where they apply to x (float32 on the CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return kernels.load()


def dropout(x: torch.Tensor, p: float, scale: bool = True) -> tuple[torch.Tensor, float]:
    """(x with dropped entries zeroed and, with scale, the kept ones scaled; the scale still to apply)."""
    threshold = round(p * 32768)
    factor = 32768 / (32768 - threshold)
    ops = _kernels(x) if threshold else None
    if ops is not None:
        return _HashDropout.apply(x, threshold, factor if scale else 1.0, ops), 1.0 if scale else factor
    keep, out_scale = keep_mask(x, p, scale)
    return x * keep, out_scale


class Dropout(nn.Module):
    """Inverted dropout with a cheap mask (see keep_mask): on CPU the RNG dominated the step, because
    the attention probabilities alone are B x H x T x T values per block. native: torch's own dropout (the
    GPU-shaped step: one fused kernel on CUDA, no seed read by the host, traceable by torch.compile)."""

    def __init__(self, p: float, native: bool = False):
        super().__init__()
        self.p, self.native = p, native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.native:
            return F.dropout(x, self.p, True)
        return dropout(x, self.p)[0]

    def unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x with dropped entries zeroed, scale still to apply): lets attention scale its smaller output."""
        if not self.training or self.p == 0:
            return x, 1.0
        if self.native:
            return F.dropout(x, self.p, True), 1.0
        return dropout(x, self.p, scale=False)

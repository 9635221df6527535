"""nn.LayerNorm with the backward of the CPU kernels (trainer/recipes/kernels.cpp) for float32 CPU tensors:
PyTorch's CPU LayerNorm backward took 5x its forward at SASRec's width of 50. Same parameters and state_dict
as nn.LayerNorm; elsewhere (GPU, other dtypes, no kernels) it is nn.LayerNorm.

    norm = LayerNorm(50, eps=1e-8)
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.recipes import kernels


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, ops):
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        out, mean, rstd = torch.native_layer_norm(flat, [shape[-1]], weight, bias, eps)
        ctx.save_for_backward(flat, mean.view(-1), rstd.view(-1), weight)
        ctx.ops = ops
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        flat, mean, rstd, weight = ctx.saved_tensors
        dx, dw, db = ctx.ops.layer_norm_backward(grad.reshape(flat.shape).contiguous(), flat, mean, rstd,
                                                 weight.contiguous())
        return dx.view(grad.shape), dw, db, None, None


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = None
        if (torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32 and
                self.elementwise_affine and self.bias is not None and len(self.normalized_shape) == 1 and
                not torch.is_autocast_enabled("cpu")):
            ops = kernels.load()
        if ops is None:
            return super().forward(x)
        return _LayerNorm.apply(x, self.weight, self.bias, self.eps, ops)

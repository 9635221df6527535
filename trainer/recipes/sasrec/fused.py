"""mHC's and SASRec attention's autograd functions over the fused CPU kernels (trainer/recipes/kernels.cpp, built by
trainer/recipes/kernels.py); the PyTorch path (model.py) is used where they cannot be built or do not apply
(GPU tensors, dtypes other than float32).

    connection = FusedConnection(n)     # one per mHC sub-layer call; see model.Sublayer

Why a C++ extension: with n = 4 streams of width 50, mHC's cost is element-wise passes over the n-times-wider
residual stream (mixing, gates, their gradients), which PyTorch runs as batched 4x4 matmuls and broadcast
temporaries; torch.compile made the epoch no faster on this CPU (README, SASRec benchmark).
"""
from __future__ import annotations

import torch

from trainer.recipes.kernels import applies  # noqa: F401 - model.py takes it from here
from trainer.recipes.kernels import load as mhc_ops


class FusedConnection:
    """One mHC sub-layer call's backward state, shared by its two functions below. The streams x feed the
    maps (_Maps: projection, gates, Sinkhorn, pre-mix) and the stream mix; autograd would write one (N, n, D)
    gradient for each and add them. Instead the stream mix leaves its output gradient here and returns none
    for x, and _Maps' backward, which autograd runs last (its outputs feed the stream mix), writes x's whole
    gradient in one pass."""

    def __init__(self, n: int):
        self.n = n
        self.grad_out = self.pre = None
        self.iterations = 0

    def maps(self, x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton=0):
        """(h, post, res) for (N, n, D) streams: the pre-mixed input, H_post and H_res; sets self.pre (H_pre,
        without gradient: it acts only through h) and self.iterations (the Sinkhorn's)."""
        return _Maps.apply(x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, self)

    def stream_mix(self, res, x, post, y):
        return _StreamMix.apply(res, x, post, y, self)

    def collapse_mix(self, res, x, post, y):
        """The stream mix's output collapsed to the mean of its streams, (N, D): the last sub-layer's."""
        return _CollapseMix.apply(res, x, post, y, self)


class _Maps(torch.autograd.Function):
    """model.MHCMaps and the pre-mix h = sum_i H_pre_i x_i: maps_in (projection, gates, pre-mix) and the Sinkhorn;
    the backward (sinkhorn_backward, maps_backward) completes x's gradient (FusedConnection)."""

    @staticmethod
    def forward(ctx, x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, conn):
        weight, gates = weight.float().contiguous(), [float(v) for v in alpha]
        biases = [v.float().contiguous() for v in (b_pre, b_post, b_res)]
        ops = mhc_ops()
        z, r, pre, post, e, h = ops.maps_in(x, weight, gates, *biases, eps)
        res, conn.iterations = ops.sinkhorn(e, iters, tol, newton)
        ctx.save_for_backward(x, weight, z, r, pre, post, res)
        ctx.conn, ctx.gates = conn, gates
        conn.pre = pre
        return h, post, res

    @staticmethod
    def backward(ctx, grad_h, grad_post, grad_res):
        x, weight, z, r, pre, post, res = ctx.saved_tensors
        conn, (tokens, n, d) = ctx.conn, x.shape
        grad_h = x.new_zeros(tokens, d) if grad_h is None else grad_h.float().contiguous()
        grad_post = torch.zeros_like(post) if grad_post is None else grad_post.float().contiguous()
        grad_res = torch.zeros_like(res) if grad_res is None else grad_res.float().contiguous()
        grad_out = torch.zeros_like(x) if conn.grad_out is None else conn.grad_out   # (no gradient came)
        ops = mhc_ops()
        grad_l = ops.sinkhorn_backward(res, grad_res)
        grad_x, grad_w, small = ops.maps_backward(x, z, r, pre, post, weight, ctx.gates, grad_post, grad_l, grad_h,
                                                  grad_out, res)
        ctx.conn = conn.grad_out = conn.pre = None
        return (grad_x, grad_w, small[:3], small[3:3 + n], small[3 + n:3 + 2 * n], small[3 + 2 * n:].view(n, n),
                None, None, None, None, None)


class _StreamMix(torch.autograd.Function):
    """H_res x + H_post^T y (model.StreamMix)."""

    @staticmethod
    def forward(ctx, res, x, post, y, conn):
        res, post, y = res.float().contiguous(), post.float().contiguous(), y.float().contiguous()
        ctx.save_for_backward(res, x, post, y)
        ctx.conn = conn
        return mhc_ops().stream_mix(res, x, post, y)

    @staticmethod
    def backward(ctx, grad):
        res, x, post, y = ctx.saved_tensors
        grad = grad.float().contiguous()
        ctx.conn.grad_out = grad
        ctx.conn = None
        grad_res, grad_post, grad_y = mhc_ops().stream_mix_backward(grad, x, post, y)
        return grad_res, None, grad_post, grad_y, None


class _CollapseMix(torch.autograd.Function):
    """mean_i (H_res x + H_post^T y)_i without writing the streams (kernels.cpp collapse_mix). Its backward leaves
    the one gradient every stream gets, (output gradient) / n as (N, 1, D), for _Maps' backward."""

    @staticmethod
    def forward(ctx, res, x, post, y, conn):
        res, post, y = res.float().contiguous(), post.float().contiguous(), y.float().contiguous()
        ctx.save_for_backward(x, post, y)
        ctx.conn = conn
        return mhc_ops().collapse_mix(res, x, post, y)

    @staticmethod
    def backward(ctx, grad):
        x, post, y = ctx.saved_tensors
        g0 = grad.float().div(x.shape[1]).contiguous()
        ctx.conn.grad_out = g0.unsqueeze(1)
        ctx.conn = None
        grad_res, grad_post, grad_y = mhc_ops().collapse_mix_backward(g0, x, post, y)
        return grad_res, None, grad_post, grad_y, None


class FusedCopiesMix(torch.autograd.Function):
    """model.CopiesMix (the first sub-layer's mix, its streams n copies of e) in kernels.cpp's copies_mix."""

    @staticmethod
    def forward(ctx, rows, e, post, y):
        rows, post, y = rows.float().contiguous(), post.float().contiguous(), y.float().contiguous()
        ctx.save_for_backward(rows, e, post, y)
        return mhc_ops().copies_mix(rows, e, post, y)

    @staticmethod
    def backward(ctx, grad):
        grad_rows, grad_post, grad_e, grad_y = mhc_ops().copies_mix_backward(grad.float().contiguous(),
                                                                             *ctx.saved_tensors)
        return grad_rows, grad_e, grad_post, grad_y


class FusedAttention(torch.autograd.Function):
    """Causal attention with dropout (kernels.cpp `attention`) over packed sequences: qkv (N, 3, H, dh), the
    float32 CPU Q/K/V projection of the real positions, row after row, and starts (B + 1 offsets, int64); T
    bounds a row's length, scale multiplies the scores. model.attention_bias's function on the real positions,
    per row in cache. One seed from torch's generator per call fixes the dropout mask (recomputed in the
    backward). Returns (N, H, dh)."""

    @staticmethod
    def forward(ctx, qkv, starts, t, scale, threshold, factor):
        seed = int(torch.randint(0, 2**62, (1,)).item())
        qkv = qkv.contiguous()
        out, lse = mhc_ops().attention(qkv, starts, t, scale, seed, threshold, factor)
        ctx.save_for_backward(qkv, starts, lse)
        ctx.args = (t, scale, seed, threshold, factor)
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, starts, lse = ctx.saved_tensors
        grad_qkv = mhc_ops().attention_backward(grad.contiguous(), qkv, starts, lse, *ctx.args)
        return grad_qkv, None, None, None, None, None

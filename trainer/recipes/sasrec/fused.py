"""mHC's and SASRec attention's autograd functions over the fused CPU kernels (mhc_kernels.inc and
attention_kernels.inc here, built by trainer/recipes/kernels.py); the PyTorch path (model.py) is used where they
cannot be built or do not apply (GPU tensors, dtypes other than float32).

    connection = FusedConnection(n)     # one per mHC sub-layer call; see model.Sublayer
    streams = BasisStreams.copies_mixed(res, e, post, y, BasisGrads())   # after the first sub-layer
    streams = streams.mixed(res, post, y)                                # after each further one

Why a C++ extension: with n = 4 streams of width 50, mHC's cost is element-wise passes over the n-times-wider
residual stream (mixing, gates, their gradients), which PyTorch runs as batched 4x4 matmuls and broadcast
temporaries; torch.compile made the epoch no faster on this CPU (README, SASRec benchmark). Between the
kernels the streams are kept in a basis form (BasisStreams), never written as (N, n, D).
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

    def copies_maps(self, e, grads, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton=0):
        """maps() for n copies of e (N, D), the first sub-layer's streams, read as e itself; e's gradient goes
        to grads (BasisGrads), e being the basis form's first vector."""
        return _CopiesMaps.apply(e, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, self, grads)

    def basis_maps(self, streams, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton=0):
        """maps() for streams in the basis form (BasisStreams)."""
        return _BasisMaps.apply(streams.coef, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, self,
                                streams.grads, *streams.basis)

    def stream_mix(self, res, x, post, y):
        return _StreamMix.apply(res, x, post, y, self)

    def collapse_mix(self, res, x, post, y):
        """The stream mix's output collapsed to the mean of its streams, (N, D): the last sub-layer's."""
        return _CollapseMix.apply(res, x, post, y, self)


def _parameters(weight, alpha, b_pre, b_post, b_res):
    """The maps' parameters as the kernels take them: float32 contiguous, the gates as floats."""
    return weight.float().contiguous(), alpha.detach().float().tolist(), [v.float().contiguous() for v in
                                                                      (b_pre, b_post, b_res)]


def _sinkhorn(conn, maps_in, iters, tol, newton):
    """maps_in's (z, r, pre, post, E, h) with the Sinkhorn run on E: (z, r, pre, post, H_res, h); H_pre and the
    iteration count on conn."""
    z, r, pre, post, e, h = maps_in
    res, conn.iterations = mhc_ops().sinkhorn(e, iters, tol, newton)
    conn.pre = pre
    return z, r, pre, post, res, h


def _incoming(h_like, post, res, grad_h, grad_post, grad_res):
    """The maps' output gradients as the kernels take them (zeros for those that did not come; h's shaped as
    h_like), grad_res carried through the Sinkhorn: (grad_h, grad_post, grad of its logits)."""
    def ready(grad, like):
        return torch.zeros_like(like) if grad is None else grad.float().contiguous()
    return ready(grad_h, h_like), ready(grad_post, post), mhc_ops().sinkhorn_backward(res, ready(grad_res, res))


def _parameter_grads(grad_w, small, n):
    """W's, alpha's, b_pre's, b_post's and b_res's gradients from maps_backward's (grad_W, small)."""
    return grad_w, small[:3], small[3:3 + n], small[3 + n:3 + 2 * n], small[3 + 2 * n:].view(n, n)


class _Maps(torch.autograd.Function):
    """model.MHCMaps and the pre-mix h = sum_i H_pre_i x_i: maps_in (projection, gates, pre-mix) and the Sinkhorn;
    the backward (sinkhorn_backward, maps_backward) completes x's gradient (FusedConnection)."""

    @staticmethod
    def forward(ctx, x, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, conn):
        weight, gates, biases = _parameters(weight, alpha, b_pre, b_post, b_res)
        z, r, pre, post, res, h = _sinkhorn(conn, mhc_ops().maps_in(x, weight, gates, *biases, eps), iters, tol,
                                            newton)
        ctx.save_for_backward(x, weight, z, r, pre, post, res)
        ctx.conn, ctx.gates = conn, gates
        return h, post, res

    @staticmethod
    def backward(ctx, grad_h, grad_post, grad_res):
        x, weight, z, r, pre, post, res = ctx.saved_tensors
        conn, n = ctx.conn, x.shape[1]
        grad_h, grad_post, grad_l = _incoming(x[:, 0], post, res, grad_h, grad_post, grad_res)
        grad_out = torch.zeros_like(x) if conn.grad_out is None else conn.grad_out   # (no gradient came)
        grad_x, grad_w, small = mhc_ops().maps_backward(x, z, r, pre, post, weight, ctx.gates, grad_post, grad_l,
                                                        grad_h, grad_out, res)
        ctx.conn = conn.grad_out = conn.pre = None
        return (grad_x, *_parameter_grads(grad_w, small, n), None, None, None, None, None)


class BasisStreams:
    """mHC's (N, n, D) streams as combinations of D-wide vectors (mhc_kernels.inc Streams): stream i of token t is
    sum_k coef[t, i, k] basis[k][t]. The streams start as n copies of the embedding e and each sub-layer's mix
    H_res x + H_post^T y adds its output y, so the l-th sub-layer's streams are combinations of e, y_0 ..
    y_{l-1}: the mix acts on the (N, n, l + 1) coefficients only, and the streams are neither written nor
    read, but expanded token by token in cache by the maps' kernels from l + 1 vectors (the mix and its
    backward read and wrote n of them). Worth it while the basis is no larger than the streams (model.py
    expands them beyond that). grads: the basis vectors' gradients, shared by the forward pass's kernels."""

    def __init__(self, coef: torch.Tensor, basis: tuple, grads: "BasisGrads"):
        self.coef, self.basis, self.grads = coef, basis, grads

    @property
    def shape(self) -> torch.Size:
        """That of the (1, N, n, D) streams they stand for (hooks and tests read them like the tensor)."""
        return torch.Size((1, *self.coef.shape[:2], self.basis[0].shape[-1]))

    def __getitem__(self, index) -> torch.Tensor:
        return self.expand().unsqueeze(0)[index]

    @classmethod
    def copies_mixed(cls, res, e, post, y, grads: "BasisGrads") -> "BasisStreams":
        """The first sub-layer's output streams H_res x + H_post^T y for x n copies of e (model.CopiesMix)."""
        return cls(_CoefMix.apply(res, torch.ones_like(post).unsqueeze(-1), post), (e, y.float().contiguous()),
                   grads)

    def mixed(self, res, post, y) -> "BasisStreams":
        """H_res x + H_post^T y: H_res times the coefficients, and y added to the basis with H_post's."""
        coef = _CoefMix.apply(res, self.coef, post)
        return BasisStreams(coef, self.basis + (y.float().contiguous(),), self.grads)

    def mean(self) -> torch.Tensor:
        """The mean of the streams, (N, D)."""
        return _BasisMean.apply(self.coef, self.grads, *self.basis)

    def expand(self) -> torch.Tensor:
        """The (N, n, D) streams themselves."""
        return torch.einsum("tik,ktd->tid", self.coef, torch.stack(self.basis))


class BasisGrads:
    """The basis vectors' gradients in the backward pass: every kernel that read a vector writes or adds its
    term into one buffer, and the vector's first reader in the forward pass, whose backward runs after all the
    others' (their inputs depend on its outputs), hands the sum to autograd (autograd would add one (N, D)
    gradient per reader)."""

    def __init__(self):
        self.buffers: list = []
        self.claimed: list[bool] = []

    def claim(self, count: int) -> list[bool]:
        """Which of the first `count` vectors this reader is the first of (its backward returns their sums)."""
        self.claimed += [False] * (count - len(self.claimed))
        owned = [not c for c in self.claimed[:count]]
        self.claimed[:count] = [True] * count
        return owned

    def take(self, basis) -> tuple[list, list[bool]]:
        """The buffers for these vectors, and whether each is fresh (to be written, not added to)."""
        self.buffers += [None] * (len(basis) - len(self.buffers))
        fresh = [b is None for b in self.buffers[:len(basis)]]
        for k, v in enumerate(basis):
            if fresh[k]:
                self.buffers[k] = torch.empty_like(v)
        return self.buffers[:len(basis)], fresh

    def hand_over(self, owned: list[bool]) -> list:
        """The finished sums of the owned vectors (None for the rest), released here."""
        out = []
        for k, own in enumerate(owned):
            out.append(self.buffers[k] if own else None)
            if own:
                self.buffers[k] = None
        return out


class _CopiesMaps(torch.autograd.Function):
    """_Maps for n copies of e (mhc_kernels.inc maps_in_copies, maps_backward_copies: e projected with the folded
    sum_i W_i); e's gradient is added into BasisGrads, whose first vector e is."""

    @staticmethod
    def forward(ctx, e, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, conn, grads):
        weight, gates, biases = _parameters(weight, alpha, b_pre, b_post, b_res)
        e = e.contiguous()
        z, r, pre, post, res, h = _sinkhorn(conn, mhc_ops().maps_in_copies(e, conn.n, weight, gates, *biases, eps),
                                            iters, tol, newton)
        ctx.save_for_backward(e, weight, z, r, pre, post, res)
        ctx.gates, ctx.grads, ctx.owned = gates, grads, grads.claim(1)
        return h, post, res

    @staticmethod
    def backward(ctx, grad_h, grad_post, grad_res):
        e, weight, z, r, pre, post, res = ctx.saved_tensors
        grad_h, grad_post, grad_l = _incoming(e, post, res, grad_h, grad_post, grad_res)
        (buffer,), (fresh,) = ctx.grads.take([e])
        grad_w, small = mhc_ops().maps_backward_copies(e, z, r, pre, post, weight, ctx.gates, grad_post, grad_l,
                                                       grad_h, buffer, fresh)
        (grad_e,) = ctx.grads.hand_over(ctx.owned)
        return (grad_e, *_parameter_grads(grad_w, small, pre.shape[1]), None, None, None, None, None, None)


class _BasisMaps(torch.autograd.Function):
    """_Maps for streams in the basis form: mhc_kernels.inc maps_in_basis and maps_backward_basis, which expand each
    token's streams in cache; the backward returns the coefficients' gradient (the mix's term is autograd's,
    BasisStreams.mixed) and adds the basis vectors' into BasisGrads."""

    @staticmethod
    def forward(ctx, coef, weight, alpha, b_pre, b_post, b_res, eps, iters, tol, newton, conn, grads, *basis):
        weight, gates, biases = _parameters(weight, alpha, b_pre, b_post, b_res)
        coef, basis = coef.contiguous(), [v.contiguous() for v in basis]
        z, r, pre, post, res, h = _sinkhorn(conn, mhc_ops().maps_in_basis(coef, basis, weight, gates, *biases, eps),
                                            iters, tol, newton)
        ctx.save_for_backward(coef, weight, z, r, pre, post, res, *basis)
        ctx.gates, ctx.grads, ctx.owned = gates, grads, grads.claim(len(basis))
        return h, post, res

    @staticmethod
    def backward(ctx, grad_h, grad_post, grad_res):
        coef, weight, z, r, pre, post, res, *basis = ctx.saved_tensors
        grad_h, grad_post, grad_l = _incoming(basis[0], post, res, grad_h, grad_post, grad_res)
        buffers, fresh = ctx.grads.take(basis)
        grad_coef, grad_w, small = mhc_ops().maps_backward_basis(coef, basis, z, r, pre, post, weight, ctx.gates,
                                                                 grad_post, grad_l, grad_h, buffers, fresh)
        return (grad_coef, *_parameter_grads(grad_w, small, coef.shape[1]), None, None, None, None, None, None,
                *ctx.grads.hand_over(ctx.owned))


class _CoefMix(torch.autograd.Function):
    """[H_res coef | H_post] (mhc_kernels.inc coef_mix): the stream mix on the basis form's coefficients."""

    @staticmethod
    def forward(ctx, res, coef, post):
        res, coef, post = res.float().contiguous(), coef.contiguous(), post.float().contiguous()
        ctx.save_for_backward(res, coef)
        return mhc_ops().coef_mix(res, coef, post)

    @staticmethod
    def backward(ctx, grad):
        return mhc_ops().coef_mix_backward(grad.float().contiguous(), *ctx.saved_tensors)


class _BasisMean(torch.autograd.Function):
    """The mean of the streams in the basis form, sum_k w[t, k] basis[k][t] with w the coefficients' mean over
    the streams (mhc_kernels.inc basis_mean): the last sub-layer's output, never written as streams."""

    @staticmethod
    def forward(ctx, coef, grads, *basis):
        coef, basis = coef.contiguous(), [v.contiguous() for v in basis]
        ctx.save_for_backward(coef, *basis)
        ctx.grads, ctx.owned = grads, grads.claim(len(basis))
        return mhc_ops().basis_mean(coef, basis)

    @staticmethod
    def backward(ctx, grad):
        coef, *basis = ctx.saved_tensors
        buffers, fresh = ctx.grads.take(basis)
        grad_coef = mhc_ops().basis_mean_backward(grad.float().contiguous(), coef, basis, buffers, fresh)
        return (grad_coef, None, *ctx.grads.hand_over(ctx.owned))


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
    """mean_i (H_res x + H_post^T y)_i without writing the streams (mhc_kernels.inc collapse_mix). Its backward leaves
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
    """model.CopiesMix (the first sub-layer's mix, its streams n copies of e) in mhc_kernels.inc's copies_mix."""

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
    """Causal attention with dropout (attention_kernels.inc `attention`) over packed sequences: qkv (N, 3, H, dh), the
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

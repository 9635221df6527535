"""SASRec (Kang & McAuley 2018), TiSASRec (Li et al. 2020) and mHC residual streams (arXiv 2512.24880).

    model = SeqRec(SeqRecConfig(time=True, mhc=True), num_items=3706, maxlen=200)
    pos_logits, neg_logits = model(seq, time, pos, neg)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.recipes.dropout import Dropout
from trainer.recipes.sasrec.config import SeqRecConfig
from trainer.recipes.sasrec.fixed import newton_fixed, newton_step, padded_sdpa, sinkhorn_fixed
from trainer.recipes.sasrec.fused import (
    BasisGrads,
    BasisStreams,
    FusedAttention,
    FusedConnection,
    FusedCopiesMix,
    applies,
    mhc_ops,
)


def sinkhorn(logits: torch.Tensor, iters: int, tol: float = 0.0, kernel: bool = False, newton: int = 0,
             fixed: bool = False) -> torch.Tensor:
    """Doubly-stochastic projection of exp(logits) over the last two dims (rows, then columns), in fp32 or fp64.

    At most `iters` iterations; with tol > 0 each map stops once its rows sum to 1 within tol (columns are exact
    after each iteration). The gradient is that of the projection itself (implicit differentiation of
    P = diag(u) exp(L) diag(v), one n x n solve per map) instead of backpropagation through every
    iteration: the unrolled graph was 40 small autograd nodes per sub-layer and most of mHC's cost.
    kernel: the same iterations and gradient in C++ (mhc_kernels.inc; float32 CPU logits, the kernels built).
    newton (tol > 0): at most this many Newton steps for the maps the iterations leave above tol
    (newton_steps). fixed: every map runs `iters` iterations and the Newton steps are masked (fixed.py: no
    host read, the GPU-shaped step's form)."""
    return _Sinkhorn.apply(logits, iters, tol, kernel, newton, fixed)


def sinkhorn_iterations(m: torch.Tensor, iters: int, tol: float) -> int:
    """Normalise m (n, n, maps) in place: rows are dim 1, columns dim 0. Maps last, because sums over a
    dimension of 4 with the maps contiguous run ~8x faster than over the last dimension of (maps, 4, 4).
    With tol > 0 each map stops before an iteration (not the first) once its rows sum to 1 within tol (divided
    by 1 from then on), so that a map's result does not depend on the maps beside it (one stop for all held every
    map for the slowest); once half of them have stopped, the running ones are carried on apart. Returns the
    iterations the slowest map ran."""
    if tol <= 0:
        for _ in range(iters):
            m.div_(m.sum(1, keepdim=True))
            m.div_(m.sum(0, keepdim=True))
        return iters
    a, live = m, None                       # the maps still running (m itself at first) and their indices
    for i in range(1, iters + 1):
        rows = a.sum(1, keepdim=True)
        running = None
        if i > 1:
            running = (rows - 1).abs().amax((0, 1)) > tol      # (a stopped map stays within tol: it is frozen)
            left = int(running.sum())
            if left == 0:
                break
            if left <= a.shape[-1] // 2:                       # carry on with the running maps apart
                if live is None:
                    live = torch.arange(m.shape[-1], device=m.device)
                else:
                    m[..., live[~running]] = a[..., ~running]
                a, rows, live, running = a[..., running], rows[..., running], live[running], None
            else:
                rows = torch.where(running, rows, 1.0)         # a stopped map is divided by 1: unchanged
        a.div_(rows)
        cols = a.sum(0, keepdim=True)
        a.div_(cols if running is None else torch.where(running, cols, 1.0))
    else:
        i = iters + 1
    if live is not None:
        m[..., live] = a
    return i - 1 if m.shape[-1] else 0


def newton_steps(p: torch.Tensor, steps: int, tol: float) -> None:
    """Up to `steps` Newton steps, in place, on the row scaling of the maps p (maps, n, n) whose rows are more
    than tol off (columns summing to 1): with the columns renormalised, the rows' sums r as a function of row
    factors exp(d) have the Jacobian diag(r) - P P^T, null along 1 (a common factor), so (J + 1 1^T) d = 1 - r,
    then rows times exp(d - max d) and the columns normalised. A map takes a step only if it lowers its largest
    row error, else it halves its step length for the next (backtracking along the same direction); it stops
    once within tol (mhc_kernels.inc newton_lanes is the same). Sinkhorn's iterations converge linearly, the slower
    the sharper the map: after 200 epochs on ml-100k rows were still off by up to 0.67 after 20 iterations, and
    reaching 1e-3 took 100 on average (up to ~800), where 20 and these steps reach 1e-4 for every map."""
    rows = p.sum(-1)
    err = (rows - 1).abs().amax(-1)
    live = (err > tol).nonzero().squeeze(1)
    q, r, e = p[live], rows[live], err[live]
    length = torch.ones_like(e)
    for _ in range(steps):
        if not len(live):
            return
        q2, r2, e2 = newton_step(q, r, length)
        take = e2 < e                                    # (NaN compares false: a failed solve is not taken)
        p[live[take]] = q2[take]
        q, r, e = torch.where(take[:, None, None], q2, q), torch.where(take[:, None], r2, r), torch.where(take, e2, e)
        length = torch.where(take, 1.0, length * 0.5)
        keep = e > tol
        live, q, r, e, length = live[keep], q[keep], r[keep], e[keep], length[keep]


class _Sinkhorn(torch.autograd.Function):
    last_iterations = 0                   # of the latest call (the recipe reports a running mean)

    @staticmethod
    def forward(ctx, logits, iters, tol, kernel=False, newton=0, fixed=False):
        ctx.dtype, ctx.kernel = logits.dtype, kernel
        if kernel:
            maps = logits.reshape(-1, *logits.shape[-2:])
            m, _Sinkhorn.last_iterations = mhc_ops().sinkhorn(
                torch.exp(maps - maps.amax((1, 2), keepdim=True)).contiguous(), iters, tol, newton)
            ctx.save_for_backward(m)
            return m.view(logits.shape)
        with torch.no_grad():
            shape = logits.shape
            x = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, *shape[-2:]).permute(1, 2, 0)
            m = torch.exp(x - x.amax(dim=(0, 1), keepdim=True)).contiguous()
            if fixed:          # (last_iterations is not set: a class attribute written stops torch.compile)
                sinkhorn_fixed(m, iters)
                maps = newton_fixed(m.permute(2, 0, 1), newton, tol) if tol > 0 and newton > 0 else m.permute(2, 0, 1)
                out = maps.contiguous().view(shape)
                ctx.save_for_backward(out)
                return out
            _Sinkhorn.last_iterations = sinkhorn_iterations(m, iters, tol)
            if tol > 0 and newton > 0:
                newton_steps(m.permute(2, 0, 1), newton, tol)
            m = m.permute(2, 0, 1).contiguous().view(shape)
        ctx.save_for_backward(m)
        return m

    @staticmethod
    def backward(ctx, grad):
        # dL = P * (G - a 1^T - 1 b^T), with a, b making its row and column sums zero (the projection is
        # invariant to adding row/column constants to L): (I - P^T P + 1 1^T) b = colsum(PG) - P^T rowsum(PG)
        (p,) = ctx.saved_tensors
        if ctx.kernel:
            n = p.shape[-1]
            return mhc_ops().sinkhorn_backward(p, grad.float().reshape(-1, n, n).contiguous()).view(grad.shape), \
                None, None, None, None, None
        pg = p * grad.float()
        rows, cols = pg.sum(-1, keepdim=True), pg.sum(-2).unsqueeze(-1)
        n = p.shape[-1]
        system = torch.eye(n, dtype=p.dtype, device=p.device) + 1.0 - p.mT @ p
        b = torch.linalg.solve_ex(system, cols - p.mT @ rows, check_errors=False)[0]
        a = rows - p @ b
        return (pg - p * (a + b.mT)).to(ctx.dtype), None, None, None, None, None


def causal_blocks(t: int, min_split: int = 64) -> list[tuple[int, int]]:
    """Query ranges for causal attention over t positions: the first half of the queries sees only the first
    half of the keys, so computing it apart skips a quarter of the T x T work. Below min_split positions the
    second call costs more than it saves; three or four blocks measured no faster than two."""
    half = t // 2 if t >= min_split else 0
    return [(0, half), (half, t)] if half else [(0, t)]


@functools.lru_cache(maxsize=16)
def causal_bias(t: int, device: torch.device) -> torch.Tensor:
    """(T, T) additive causal bias: 0 on and below the diagonal, -inf above (one per length, reused)."""
    return torch.full((t, t), float("-inf"), device=device).triu_(1)


def attention_bias(seq: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) additive bias (0 / -inf): causal, no padded keys, but always the diagonal so a padded
    query has one key (no NaN). One broadcast add and a pass over the diagonal: building boolean masks and
    filling a zero tensor from them read and wrote the B x T x T map five times."""
    pad = torch.zeros(seq.shape, device=seq.device).masked_fill_(seq == 0, float("-inf"))
    causal = causal_bias.__wrapped__ if torch.compiler.is_compiling() else causal_bias   # (a constant there)
    bias = causal(seq.shape[1], seq.device) + pad[:, None, None, :]
    bias.diagonal(dim1=-2, dim2=-1).zero_()
    return bias


class AttentionMask:
    """The attention mask of a batch: attention_bias's (B, 1, T, T) `bias` and, given the timestamps, TiSASRec's
    (B, T, T) clamped intervals `rel`, each built on first use (the packed path never builds a T x T map)."""

    def __init__(self, seq: torch.Tensor, time: torch.Tensor | None = None, span: int = 0):
        self.seq, self.time, self.span = seq, time, span
        self._buckets: dict[tuple[int, int], AttentionMask] = {}
        self._bias = self._rel = None    # (not functools.cached_property: its lock stops torch.compile's tracing)

    @property
    def bias(self) -> torch.Tensor:
        if self._bias is None:
            self._bias = attention_bias(self.seq)
        return self._bias

    @property
    def rel(self) -> torch.Tensor:
        if self._rel is None:
            self._rel = (self.time.unsqueeze(2) - self.time.unsqueeze(1)).abs().clamp(max=self.span)
        return self._rel

    def rows(self, rows: torch.Tensor | None, cut: int) -> AttentionMask:
        """The mask of a length bucket: those rows, from position cut on; one per bucket, shared by the blocks
        (each would build the bucket's bias and intervals again)."""
        if rows is None:
            return self
        key = (id(rows), cut)                       # the packing's own row tensors, alive for the step
        if key not in self._buckets:
            time = None if self.time is None else self.time[rows, cut:]
            self._buckets[key] = AttentionMask(self.seq[rows, cut:], time, self.span)
        return self._buckets[key]


def length_groups(seq: torch.Tensor, buckets: int) -> list[tuple[torch.Tensor | None, int]]:
    """(rows, cut) per length bucket: rows sorted by length and split into `buckets` groups, each trimmed of its
    common left padding (positions cut..); [(None, 0)], the whole batch, when too few rows to split."""
    t = seq.shape[1]
    if buckets <= 1 or seq.shape[0] < 2 * buckets:
        return [(None, 0)]
    # a row's span from its first real position (a padded item inside a row must not shorten it)
    lengths = t - torch.where(seq != 0, torch.arange(t, device=seq.device), t).amin(1)
    return [(rows, t - max(int(lengths[rows].max()), 1))
            for rows in torch.argsort(lengths, descending=True).chunk(buckets)]


class Packing:
    """The real (non-padded) positions of a (B, T) batch, row after row: `index` into the flattened batch and
    `starts`, row b's tokens being starts[b] .. starts[b + 1] - 1 of the packed order. With buckets > 1, also
    the length buckets (length_groups: `groups`) that `per_bucket` unpacks to. dense (the GPU-shaped step):
    every position, padded ones included, in the same interface: a reshape each way, no nonzero (the padded
    positions then carry values that real ones never read: their keys are masked and their losses weighted 0)."""

    def __init__(self, seq: torch.Tensor, buckets: int = 1, dense: bool = False):
        self.batch, self.length = seq.shape
        self.index = self.groups = None
        if dense:
            return
        real = seq != 0
        self.index = real.view(-1).nonzero().squeeze(1)
        self.starts = F.pad(real.sum(1).cumsum(0), (1, 0))
        self.groups = self._groups(seq, buckets)

    def _groups(self, seq: torch.Tensor, buckets: int):
        """(rows, cut) per length bucket, and self.slots: where each packed position lies in the buckets'
        padded blocks (len(rows), T - cut) laid end to end."""
        groups = length_groups(seq, buckets)
        if len(groups) == 1:
            return None
        slot = torch.full((self.batch * self.length,), -1, dtype=torch.long, device=seq.device)
        slot[self.index] = torch.arange(len(self.index), device=seq.device)
        slot, base, srcs, dests = slot.view(self.batch, self.length), 0, [], []
        for rows, cut in groups:
            sub = slot[rows, cut:].reshape(-1)
            where = (sub >= 0).nonzero().squeeze(1)
            srcs.append(sub[where])
            dests.append(where + base)
            base += sub.numel()
        self.slots = torch.empty_like(self.index).index_copy_(0, torch.cat(srcs), torch.cat(dests))
        self.padded = base
        return groups

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...), the real positions."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, T, ...), zeros at the padded positions (dense: as they are)."""
        if self.index is None:
            return x.view(self.batch, self.length, *x.shape[1:])
        full = x.new_zeros(self.batch * self.length, *x.shape[1:]).index_copy_(0, self.index, x)
        return full.view(self.batch, self.length, *x.shape[1:])

    def per_bucket(self, x: torch.Tensor, fn) -> torch.Tensor:
        """fn on the padded form of the packed (N, ...) x, one length bucket at a time: fn(x_b, rows, cut) takes
        and returns (len(rows), T - cut, ...), zeros at padded positions (rows None: the whole batch, cut 0).
        Returns the packed result. One scatter into all buckets' blocks and one gather back (per bucket, the
        copies and their gradients were a twentieth of TiSASRec+mHC's epoch)."""
        if self.groups is None:
            return self.pack(fn(self.unpack(x), None, 0))
        blocks, parts, at = x.new_zeros(self.padded, *x.shape[1:]).index_copy_(0, self.slots, x), [], 0
        for rows, cut in self.groups:
            shape = (len(rows), self.length - cut)
            out = fn(blocks[at:at + shape[0] * shape[1]].view(*shape, *x.shape[1:]), rows, cut)
            parts.append(out.reshape(shape[0] * shape[1], *out.shape[2:]))
            at += shape[0] * shape[1]
        return torch.cat(parts).index_select(0, self.slots)


class FeedForward(nn.Module):
    """Point-wise FFN (the papers' two 1x1 convolutions)."""

    def __init__(self, d: int, p: float, native_dropout: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), Dropout(p, native_dropout), nn.ReLU(), nn.Linear(d, d),
                                 Dropout(p, native_dropout))

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        return self.net(x)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; with time=True the TiSASRec relation terms are added:
    scores += Q.E_K[r_ij] + Q.P_K[j], outputs += sum_j a_ij (E_V[r_ij] + P_V[j])."""

    def __init__(self, d: int, heads: int, p: float, maxlen: int, time: bool, time_span: int, fused: bool = True,
                 fixed: bool = False):
        super().__init__()
        if d % heads:
            raise ValueError(f"model.width={d} is not divisible by model.heads={heads}")
        self.h, self.dh, self.time, self.fused, self.fixed = heads, d // heads, time, fused and not fixed, fixed
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.attn_drop = Dropout(p, fixed)
        if time:
            self.pos_k, self.pos_v = nn.Embedding(maxlen, d), nn.Embedding(maxlen, d)
            self.time_k, self.time_v = nn.Embedding(time_span + 1, d), nn.Embedding(time_span + 1, d)
            self.emb_drop = Dropout(p, fixed)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.dh).transpose(1, 2)          # (B, H, T, dh)

    def forward(self, x: torch.Tensor, mask: AttentionMask, offset: int = 0,
                packing: Packing | None = None, source: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, D), or with `packing` the real positions' (N, D); offset: how many leading (all-padding)
        positions were trimmed, so absolute positions stay those of the full length. Packed x without the
        kernel: the padded attention per length bucket of the packing. source: the keys' and values' input
        when it is not x (model.norm=original), in x's form."""
        if packing is not None:
            if self.packs(x):
                return self.out(self._kernel_attention(self._qkv(x, source), packing))
            assert source is None, "packed without the kernel: mHC, whose sub-layers take no source"
            return packing.per_bucket(x, lambda xb, rows, cut: self.forward(xb, mask.rows(rows, cut), offset + cut))
        q, k, v = (self._split(part) for part in self._qkv(x, source).chunk(3, -1))
        return self._attend(q, k, v, mask, offset)

    def _attend(self, q, k, v, mask: AttentionMask, offset: int) -> torch.Tensor:
        if self.time:
            out = self._time_attention(q, k, v, mask, offset)
        elif self.fixed:           # the GPU-shaped step: one fused kernel, torch's dropout inside it
            out = padded_sdpa(q, k, v, mask.bias, self.attn_drop.p if self.training else 0.0, self.dh ** -0.5)
        elif not self.training or self.attn_drop.p == 0:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bias.to(q.dtype))   # fused kernel
        else:
            out = self._dropout_attention(q, k, v, mask)
        b, _, t, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(b, t, self.h * self.dh))

    def _qkv(self, x: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """(..., 3D): Q, K and V from one (D, 3D) product (and one for x's gradient): three reads of x and two
        gradient additions fewer; the parameters stay three Linear layers. source: K and V's input, if not x."""
        if source is not None:
            return torch.cat([self.q(x), F.linear(source, torch.cat([self.k.weight, self.v.weight]),
                                                  torch.cat([self.k.bias, self.v.bias]))], -1)
        return F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]),
                        torch.cat([self.q.bias, self.k.bias, self.v.bias]))

    def packs(self, x: torch.Tensor) -> bool:
        """Whether training attention on x runs packed in the C++ kernel (SASRec, float32 CPU, built)."""
        return (self.fused and self.training and not self.time and applies(x)
                and not torch.is_autocast_enabled(x.device.type) and mhc_ops() is not None)

    def _kernel_attention(self, qkv: torch.Tensor, packing: Packing) -> torch.Tensor:
        """_dropout_attention's function on the packed real positions, one C++ call (fused.FusedAttention)
        reading Q, K and V where the projection wrote them."""
        threshold = round(self.attn_drop.p * 32768)
        out = FusedAttention.apply(qkv.view(-1, 3, self.h, self.dh), packing.starts, packing.length,
                                   self.dh ** -0.5, threshold, 32768 / (32768 - threshold))
        return out.view(-1, self.h * self.dh)

    def _dropout_attention(self, q, k, v, mask):
        """Explicit softmax so the fast dropout applies; the mask added inside the matmul."""
        b, h, t, dh = q.shape
        q, k, v = (q * dh ** -0.5).reshape(b * h, t, dh), k.reshape(b * h, t, dh), v.reshape(b * h, t, dh)
        bias = mask.bias.to(q.dtype).expand(b, h, t, t).reshape(b * h, t, t)
        outs, scale = [], 1.0
        for lo, hi in causal_blocks(t):
            scores = torch.baddbmm(bias[:, lo:hi, :hi], q[:, lo:hi], k[:, :hi].mT)
            probs, scale = self.attn_drop.unscaled(torch.softmax(scores, -1))
            outs.append(probs @ v[:, :hi])
        return (torch.cat(outs, 1) * scale).view(b, h, t, dh)

    def _time_attention(self, q, k, v, mask, offset):
        t, rel = q.shape[2], mask.rel
        pos = torch.arange(offset, offset + t, device=q.device)
        pk = self.emb_drop(self.pos_k(pos)).view(t, self.h, self.dh)
        pv = self.emb_drop(self.pos_v(pos)).view(t, self.h, self.dh)
        ek = self.emb_drop(self.time_k.weight).view(-1, self.h, self.dh)  # (S+1, H, dh)
        ev = self.emb_drop(self.time_v.weight).view(-1, self.h, self.dh)
        keys, values = k + pk.transpose(0, 1), v + pv.transpose(0, 1)
        idx = rel.unsqueeze(1).expand(-1, self.h, -1, -1)                 # (B, H, T, T)
        outs = []
        for lo, hi in causal_blocks(t):
            qb, ib = q[:, :, lo:hi], idx[:, :, lo:hi, :hi]
            scores = qb @ keys[:, :, :hi].transpose(-1, -2)
            scores = scores + torch.einsum("bhtd,shd->bhts", qb, ek).gather(-1, ib)
            scores = scores / math.sqrt(self.dh)
            attn = self.attn_drop(torch.softmax(scores + mask.bias[..., lo:hi, :hi].to(scores.dtype), -1))
            bins = torch.zeros(*attn.shape[:-1], ek.shape[0], dtype=attn.dtype, device=attn.device)
            bins.scatter_add_(-1, ib, attn)                               # sum of a_ij per interval
            outs.append(attn @ values[:, :, :hi] + torch.einsum("bhts,shd->bhtd", bins, ev.to(attn.dtype)))
        return torch.cat(outs, 2)


class MHCMaps(nn.Module):
    """Per-token H_pre (1xn), H_post (1xn) and doubly-stochastic H_res (nxn) from the RMSNorm'd streams."""

    def __init__(self, n: int, d: int, cfg: SeqRecConfig, fixed: bool = False):
        super().__init__()
        self.n, self.iters, self.tol, self.fp32 = n, cfg.mhc_sinkhorn_iters, cfg.mhc_sinkhorn_tol, cfg.mhc_fp32
        self.fixed = fixed           # Sinkhorn without host reads (fixed.py): the GPU-shaped step
        self.newton = cfg.mhc_newton_steps
        self.norm = nn.RMSNorm(n * d)
        self.proj = nn.Linear(n * d, 2 * n + n * n, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02)
        self.alpha = nn.Parameter(torch.full((3,), cfg.mhc_gate_init))   # small gates: start near identity
        self.b_pre = nn.Parameter(torch.full((n,), math.log(1 / (n - 1)) if n > 1 else 10.0))  # H_pre = 1/n
        self.b_post = nn.Parameter(torch.zeros(n))                                             # H_post = 1
        self.b_res = nn.Parameter(torch.full((n, n), -4.0).fill_diagonal_(0.0))               # H_res ~ I
        self.reset_counts()

    def reset_counts(self) -> None:
        """The Sinkhorn's statistics the recipe logs per epoch: its mean iteration count per call and its
        largest row error (|row sum - 1|; columns are exact), a tensor so that the GPU is not waited for."""
        self.sinkhorn_calls = self.sinkhorn_iterations = 0
        self.sinkhorn_row_error = None

    def _count(self, res: torch.Tensor, iterations: int) -> None:
        self.sinkhorn_calls += 1
        self.sinkhorn_iterations += iterations
        if res.numel():
            res = res.detach()
            ops = mhc_ops() if not self.fixed and applies(res) and res.is_contiguous() else None   # (one pass)
            err = torch.tensor(ops.row_error(res.view(-1, *res.shape[-2:]))) if ops else \
                (res.sum(-1) - 1).abs().amax().float()
            last = self.sinkhorn_row_error
            self.sinkhorn_row_error = err if last is None else torch.maximum(last, err)

    def forward(self, x: torch.Tensor | BasisStreams, conn: FusedConnection | None = None):
        """conn: the fused kernels' connection (fused.py) for this call, or None for the PyTorch path (x a
        tensor); the fused kernels pre-mix h (conn.h)."""
        if isinstance(x, BasisStreams):
            return self._basis_maps(x, conn)
        if self.fp32 and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self._maps(x.float(), conn)
        return self._maps(x, conn)

    def from_copies(self, e: torch.Tensor, kernel: bool):
        """The maps for streams that are n copies of e (N, D), the first sub-layer's: the copies' projection is
        (sum_i W_i) e and their RMS e's, so the n-times-wider streams are neither written nor read.
        kernel: Sinkhorn in C++ (float32 CPU)."""
        if self.fp32 and torch.is_autocast_enabled(e.device.type):
            with torch.autocast(e.device.type, enabled=False):
                return self._copies_maps(e.float(), kernel)
        return self._copies_maps(e, kernel)

    def _copies_maps(self, e: torch.Tensor, kernel: bool):
        eps = self.norm.eps if self.norm.eps is not None else torch.finfo(e.dtype).eps
        weight = (self.proj.weight * self.norm.weight).view(-1, self.n, e.shape[-1]).sum(1)
        return self._gates(NormProj.apply(e, weight, eps), kernel)

    def _gates(self, z: torch.Tensor, kernel: bool = False):
        """(H_pre, H_post, H_res) from the normalised projection z (..., 2n + n^2)."""
        n = self.n
        pre = torch.sigmoid(self.alpha[0] * z[..., :n] + self.b_pre)
        post = 2 * torch.sigmoid(self.alpha[1] * z[..., n:2 * n] + self.b_post)
        res = sinkhorn(self.alpha[2] * z[..., 2 * n:].unflatten(-1, (n, n)) + self.b_res, self.iters, self.tol, kernel,
                       self.newton, self.fixed)
        self._count(res, self.iters if self.fixed else _Sinkhorn.last_iterations)
        return pre, post, res

    def copies_kernel(self, e: torch.Tensor, conn: FusedConnection, grads):
        """from_copies in the kernels, for the basis form (e its first vector; grads: its BasisGrads): (H_pre,
        H_post, H_res), h = (sum_i H_pre_i) e in conn.h."""
        post, res = self._in_kernels(conn, conn.copies_maps, e.dtype, e, grads)
        return conn.pre, post, res

    def _basis_maps(self, streams: BasisStreams, conn: FusedConnection):
        """_maps for streams in the basis form (fused.BasisStreams), in the kernels."""
        post, res = self._in_kernels(conn, conn.basis_maps, streams.coef.dtype, streams)
        tokens, n = post.shape
        return conn.pre.view(1, tokens, n), post.view(1, tokens, n), res.view(1, tokens, n, n)

    def _in_kernels(self, conn: FusedConnection, maps, dtype, *inputs):
        """One of conn's maps functions (`maps`) on `inputs` with this module's parameters, counted: (H_post,
        H_res); h in conn.h, H_pre in conn.pre."""
        eps, weight = self._folded(dtype)
        conn.h, post, res = maps(*inputs, weight, self.alpha, self.b_pre, self.b_post, self.b_res, eps, self.iters,
                                 self.tol, self.newton)
        self._count(res, conn.iterations)
        return post, res

    def _folded(self, dtype):
        # RMSNorm folded into the projection: (x r w) W^T = r (x (W w)^T), so the normalised copy of the
        # n-times-wider stream is never written
        eps = self.norm.eps if self.norm.eps is not None else torch.finfo(dtype).eps
        return eps, self.proj.weight * self.norm.weight

    def _maps(self, x: torch.Tensor, conn: FusedConnection | None):
        b, t, n, d = x.shape
        if conn is None:
            eps, weight = self._folded(x.dtype)
            return self._gates(NormProj.apply(x.reshape(b * t, n * d), weight, eps).view(b, t, -1))
        # all in the kernels, which also pre-mix (conn.h)
        post, res = self._in_kernels(conn, conn.maps, x.dtype, x.reshape(b * t, n, d))
        return conn.pre.view(b, t, n), post.view(b, t, n), res.view(b, t, n, n)


class StreamMix(torch.autograd.Function):
    """H_res x + H_post^T y for (N, n, n) res, (N, n, D) streams x, (N, n) post and (N, D) y. The backward
    is four batched matmuls: autograd's broadcast-multiply-then-sum wrote an n-times-wider temporary for
    each of the post and y gradients."""

    @staticmethod
    def forward(ctx, res, x, post, y):
        res, post, y = res.to(x.dtype), post.to(x.dtype), y.to(x.dtype)
        ctx.save_for_backward(res, x, post, y)
        with torch.autocast(x.device.type, enabled=False):    # the streams keep their dtype under AMP
            return torch.bmm(res, x).addcmul_(post.unsqueeze(-1), y.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad):
        res, x, post, y = ctx.saved_tensors
        grad = grad.to(x.dtype).contiguous()         # (bmm with a transposed batch of 4x4 maps was ~10x slower on CPU)
        return (torch.bmm(grad, x.mT), torch.bmm(res.mT.contiguous(), grad),
                torch.bmm(grad, y.unsqueeze(-1)).squeeze(-1), torch.bmm(post.unsqueeze(1), grad).squeeze(1))


class CopiesMix(torch.autograd.Function):
    """StreamMix for streams that are n copies of e (the first sub-layer's): sum_j H_res_ij e + post_i y =
    rows_i e + post_i y, with rows the row sums of H_res; (N, n) rows and post, (N, D) e and y. fused.py's
    FusedCopiesMix is the same in one C++ pass each way."""

    @staticmethod
    def forward(ctx, rows, e, post, y):
        rows, post, y = rows.to(e.dtype), post.to(e.dtype), y.to(e.dtype)
        ctx.save_for_backward(rows, e, post, y)
        with torch.autocast(e.device.type, enabled=False):    # the streams keep their dtype under AMP
            return (rows.unsqueeze(-1) * e.unsqueeze(1)).addcmul_(post.unsqueeze(-1), y.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad):
        rows, e, post, y = ctx.saved_tensors
        grad = grad.to(e.dtype)
        return ((grad * e.unsqueeze(1)).sum(-1), (rows.unsqueeze(-1) * grad).sum(1),
                (grad * y.unsqueeze(1)).sum(-1), (post.unsqueeze(-1) * grad).sum(1))


class NormProj(torch.autograd.Function):
    """z = RMSNorm(x) W^T for (N, n*D) streams, as r (x W^T) with r = 1/rms(x): the normalised copy of the
    wide stream is never written, and the backward is two matmuls and one in-place update instead of
    autograd's eight wide element-wise passes."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        width, weight = x.shape[-1], weight.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):    # mhc_fp32=false: the stream's own dtype
            r = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(width).add_(eps))
            a = x @ weight.t()
        ctx.save_for_backward(x, weight, r, a)
        return a * r

    @staticmethod
    def backward(ctx, grad):
        x, weight, r, a = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_a = grad * r
        coef = (grad * a).sum(-1, keepdim=True) * r.pow(3) / -x.shape[-1]   # d r / d x = -r^3 x / width
        grad_x = (grad_a @ weight).addcmul_(x, coef)
        return grad_x, grad_a.t() @ x, None


class Sublayer(nn.Module):
    """One residual sub-layer (attention or FFN) with a LayerNorm, as plain or mHC connection."""

    def __init__(self, fn: nn.Module, d: int, cfg: SeqRecConfig, fixed: bool = False):
        super().__init__()
        self.fn, self.norm, self.form = fn, nn.LayerNorm(d, eps=1e-8), cfg.norm
        self.maps = MHCMaps(cfg.mhc_streams, d, cfg, fixed) if cfg.mhc else None
        self.fused = cfg.mhc and cfg.mhc_fused and not fixed
        # the streams in the basis form (fused.BasisStreams) between the kernels; not under grad_checkpoint,
        # whose recomputation would run the forward's bookkeeping (BasisGrads) twice
        self.basis = self.fused and not cfg.grad_checkpoint

    def forward(self, x: torch.Tensor | BasisStreams, collapse: bool = False, **kw):
        """x: (B, T, D), or the real positions' (N, D) given `packing` (the attention's keyword); mHC: (1, N, n, D),
        the streams of the N real positions only (the streams of padded positions would stay zero: zero input,
        zero output, so they are neither stored nor computed), or between the fused kernels the same streams in
        the basis form (fused.BasisStreams), the first sub-layer's being the embedding (N, D) itself. collapse
        (mHC, the last sub-layer): return the mean of the output streams, (N, D), never written as streams."""
        if self.maps is None:
            if self.form == "pre":
                return x + self.fn(self.norm(x), **kw)
            if self.form == "post":
                return self.norm(x + self.fn(x, **kw))
            # original (both papers' code): the residual is the normalised input; attention's keys and values
            # are the raw x (SelfAttention's `source`), its queries the normalised x
            h = self.norm(x)
            return h + self.fn(h, source=x, **kw)
        if isinstance(x, BasisStreams):
            return self._from_basis(x, collapse, **kw)
        if x.dim() == 2:
            return self._from_copies(x, **kw)
        _, tokens, n, d = x.shape
        conn = FusedConnection(n) if self.fused and applies(x) and x.is_contiguous() and mhc_ops() else None
        pre, post, res = self.maps(x, conn)
        if conn is not None:
            h = conn.h                                                   # pre-mixed by the maps' kernel
        else:
            h = (pre.unsqueeze(-1).to(x.dtype) * x).sum(2)
        y = self.fn(self.norm(h.view(tokens, d)), **kw)
        args = (res.reshape(tokens, n, n), x.view(tokens, n, d), post.reshape(tokens, n), y)
        if collapse and conn is not None:
            return conn.collapse_mix(*args)
        out = (conn.stream_mix if conn is not None else StreamMix.apply)(*args)
        return out.mean(1) if collapse else out.view(1, tokens, n, d)

    def _from_copies(self, e: torch.Tensor, **kw) -> torch.Tensor:
        """The first sub-layer, whose streams are n copies of the embedding e (N, D): the maps from e alone
        (MHCMaps.from_copies), h = (sum_i H_pre_i) e, and the streams written once, by the mix."""
        tokens, d = e.shape
        kernel = self.fused and applies(e) and e.is_contiguous() and mhc_ops() is not None
        if kernel and self.basis and not torch.is_autocast_enabled(e.device.type):
            conn, grads = FusedConnection(self.maps.n), BasisGrads()
            _, post, res = self.maps.copies_kernel(e, conn, grads)
            return BasisStreams.copies_mixed(res, e, post, self.fn(self.norm(conn.h), **kw), grads)
        pre, post, res = self.maps.from_copies(e, kernel)
        y = self.fn(self.norm(pre.sum(-1, keepdim=True).to(e.dtype) * e), **kw)
        mix = FusedCopiesMix if kernel else CopiesMix
        return mix.apply(res.sum(-1), e, post, y).view(1, tokens, self.maps.n, d)

    def _from_basis(self, x: BasisStreams, collapse: bool, **kw):
        """A sub-layer on streams in the basis form (fused.BasisStreams): the maps' kernels expand them in
        cache, the mix acts on their coefficients. Expanded once the basis would outgrow the n streams."""
        n = self.maps.n
        if len(x.basis) > n:
            return self.forward(x.expand().unsqueeze(0), collapse, **kw)
        conn = FusedConnection(n)
        _, post, res = self.maps(x, conn)
        y = self.fn(self.norm(conn.h), **kw)
        out = x.mixed(res[0], post[0], y)
        return out.mean() if collapse else out


class Block(nn.Module):
    """Attention then feed-forward sub-layer; padded positions are zeroed after each block (or not stored)."""

    def __init__(self, d: int, cfg: SeqRecConfig, maxlen: int, fixed: bool = False):
        super().__init__()
        self.attn = Sublayer(SelfAttention(d, cfg.heads, cfg.dropout, maxlen, cfg.time, cfg.time_span,
                                           cfg.attention_fused, fixed), d, cfg, fixed)
        self.ffn = Sublayer(FeedForward(d, cfg.dropout, fixed), d, cfg, fixed)

    def forward(self, x, keep, mask, offset, packing=None, last=False):
        """x: (B, T, D), or the real positions only (packing: Packing). last (mHC): the final block, whose
        streams are collapsed to their mean (Sublayer's collapse)."""
        x = self.ffn(self.attn(x, mask=mask, offset=offset, packing=packing), collapse=last)
        return x if packing is not None else x * keep


class SeqRec(nn.Module):
    """Item embeddings -> blocks -> final LayerNorm; scores are dot products with item embeddings."""

    def __init__(self, cfg: SeqRecConfig, num_items: int, maxlen: int, fixed_shapes: bool = False):
        """fixed_shapes: the GPU-shaped step (chosen by the recipe from the device, train.gpu_path): every batch
        at full length (no packing, no length buckets: no nonzero, no host read), torch's dropout and
        scaled_dot_product_attention, Sinkhorn with a fixed iteration count (fixed.py); the C++ kernels off.
        The parameters are the same, so a checkpoint moves between the two forms."""
        super().__init__()
        if fixed_shapes:
            cfg = dataclasses.replace(cfg, length_buckets=1)
        self.cfg, self.maxlen, self.fixed = cfg, maxlen, fixed_shapes
        d = cfg.width
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = None if cfg.time else nn.Embedding(maxlen + 1, d, padding_idx=0)
        self.drop = Dropout(cfg.dropout, fixed_shapes)
        self.blocks = nn.ModuleList(Block(d, cfg, maxlen, fixed_shapes) for _ in range(cfg.depth))
        self.last_norm = nn.LayerNorm(d, eps=1e-8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """model.init: xavier-normal matrices as in both papers' code (PyTorch's N(0, 1) embeddings train far
        slower), or N(0, init_std) matrices with zero biases; the mHC maps keep their near-identity
        initialisation either way."""
        normal = self.cfg.init == "normal"
        for name, param in self.named_parameters():
            if ".maps." in name:
                continue
            if param.dim() >= 2:
                nn.init.normal_(param, std=self.cfg.init_std) if normal else nn.init.xavier_normal_(param)
            elif normal and name.endswith(".bias"):       # (a LayerNorm's bias is zero already)
                nn.init.zeros_(param)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()
            if self.pos_emb is not None:
                self.pos_emb.weight[0].zero_()

    def _masks(self, seq: torch.Tensor, time: torch.Tensor):
        return (seq != 0).unsqueeze(-1), AttentionMask(seq, time if self.cfg.time else None, self.cfg.time_span)

    def buckets(self, seq: torch.Tensor, time: torch.Tensor):
        """(rows, cut, h) per length bucket: h (len(rows), T - cut, D) is the representation of positions
        cut.. of those rows, trimmed of their common left padding. Padded keys are masked and positions keep
        their full-length index, so h equals the slice of one padded batch, at a fraction of the cost."""
        for rows, cut in length_groups(seq, self.cfg.length_buckets):
            if rows is None:
                yield None, 0, self._features(seq, time, 0)
            else:
                yield rows, cut, self._features(seq[rows, cut:], time[rows, cut:], cut)

    @staticmethod
    def _assemble(parts) -> torch.Tensor:
        """One (B, T, ...) tensor from per-bucket (rows, cut, value) parts, left-padded with zeros back to full
        length and put in row order. Written once: an index_put per bucket copied the whole (B, T, D) result
        each time (a third of SASRec's step)."""
        parts = list(parts)
        if parts[0][0] is None:
            return parts[0][2]
        padded = [F.pad(v, (0, 0) * (v.dim() - 2) + (cut, 0)) if cut else v for _, cut, v in parts]
        order = torch.cat([rows for rows, _, _ in parts])
        return torch.cat(padded).index_select(0, torch.argsort(order))

    def features(self, seq: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """(B, T, D) representation of every prefix (zeros at padded positions)."""
        return self._assemble(self.buckets(seq, time))

    def _features(self, seq: torch.Tensor, time: torch.Tensor, offset: int, packing: Packing | None = None):
        """(B, T, D) representation of every prefix (zeros at padded positions); given `packing`, the real
        positions' (N, D). mHC always computes on the real positions (see Sublayer.forward)."""
        keep, mask = self._masks(seq, time)
        packed = packing or (Packing(seq, dense=self.fixed) if self.cfg.mhc else None)
        x = self._embed(seq, offset, keep, packed)
        # mHC: the streams start as n copies of x, which the first sub-layer takes as x itself
        # (Sublayer._from_copies) and turns into the (1, N, n, D) streams
        for i, block in enumerate(self.blocks):
            # mHC: the last block's FFN collapses the streams to their mean, once, at the end
            last = self.cfg.mhc and i == len(self.blocks) - 1
            if self.cfg.grad_checkpoint and self.training:
                x = checkpoint(block, x, keep, mask, offset, packed, last, use_reentrant=False)
            else:
                x = block(x, keep, mask, offset, packed, last)
        if packed is None:
            return self.last_norm(x) * keep
        x = self.last_norm(x)
        if packing is not None:
            return x
        return packed.unpack(x) * keep if packed.index is None else packed.unpack(x)

    def _embed(self, seq: torch.Tensor, offset: int, keep: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        """Item (and position) embeddings with dropout, of every position or the packed real ones."""
        ids = seq if packing is None else packing.pack(seq)
        x = self.item_emb(ids) * math.sqrt(self.cfg.width)
        if self.pos_emb is not None:
            if self.cfg.positions == "from_start":       # (a trimmed prefix is all padding: nothing to count)
                positions = (seq != 0).cumsum(1) * (seq != 0)
            else:
                positions = torch.arange(offset + 1, offset + seq.shape[1] + 1, device=seq.device) * (seq != 0)
            x = x + self.pos_emb(positions if packing is None else packing.pack(positions))
        x = self.drop(x)
        return x * keep if packing is None else x

    def packs(self, seq: torch.Tensor) -> bool:
        """Whether training runs on the packed real positions of the whole batch: with the attention kernel
        (SASRec, float32 CPU: the bucketed padded batch computed a fifth more positions in every position-wise
        op), or with mHC, whose streams are kept for the real positions only anyway (per bucket, it ran four
        times as many small calls); without the kernel the attention alone runs per length bucket."""
        return self.cfg.mhc or self._kernel_attention(seq)

    def _kernel_attention(self, seq: torch.Tensor) -> bool:
        return self.blocks[0].attn.fn.packs(self.item_emb.weight) and seq.device.type == "cpu"

    def forward(self, seq, time, pos, neg):
        """Training logits: (B, T) for the next items and (B, T, K) for the sampled negatives. Computed on the
        real positions (packs) or per length bucket on the trimmed positions; only the logits are put back at
        full length. pos None: the (B, T, D) features (loss.kind=ce scores them against every item)."""
        if pos is None:
            return self.features(seq, time)
        def logits(h, p, n):
            # a multiply-and-sum: einsum made K=1 a batched matmul of B*T 1x1 products
            return torch.cat([(h * self.item_emb(p)).sum(-1, keepdim=True),
                              (h.unsqueeze(-2) * self.item_emb(n)).sum(-1)], -1)
        if self.packs(seq):
            packing = Packing(seq, 1 if self._kernel_attention(seq) else self.cfg.length_buckets, dense=self.fixed)
            out = packing.unpack(logits(self._features(seq, time, 0, packing), packing.pack(pos), packing.pack(neg)))
        else:
            out = self._assemble((r, c, logits(h, *((pos, neg) if r is None else (pos[r, c:], neg[r, c:]))))
                                 for r, c, h in self.buckets(seq, time))
        return out[..., 0], out[..., 1:]

    def score(self, seq, time, items: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of candidate items (B, C), or of every item (B, num_items + 1) when items is None."""
        h = self._assemble((r, 0, h[:, -1:]) for r, _, h in self.buckets(seq, time))[:, 0]
        if items is None:
            return h @ self.item_emb.weight.t()
        return torch.einsum("bd,bcd->bc", h, self.item_emb(items))

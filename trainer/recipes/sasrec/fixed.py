"""The GPU-shaped forms of SASRec's data-dependent pieces: fixed shapes, no host reads, so a step queues its
kernels without waiting and can be compiled whole and captured as a CUDA graph (model.SeqRec(fixed_shapes=True)).

    m = sinkhorn_fixed(m, iters=20)                     # (n, n, maps): every map the same number of iterations
    newton_fixed(p, steps=8, tol=1e-4)                  # (maps, n, n): masked steps, no nonzero
    out = padded_sdpa(q, k, v, bias, dropout_p, scale)  # head dims padded to a multiple of 8

The CPU path stops each map once within the tolerance and carries on the running ones apart (model.py
sinkhorn_iterations): a count the host reads every iteration. Here every map runs `iters` iterations (a map
within the tolerance moves by less than it) and the Newton steps (model.newton_steps) act on every map with a
mask: a map within the tolerance takes none, as there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn_fixed(m: torch.Tensor, iters: int) -> None:
    """Normalise m (n, n, maps) in place, rows (dim 1) then columns (dim 0), `iters` times."""
    for _ in range(iters):
        m.div_(m.sum(1, keepdim=True))
        m.div_(m.sum(0, keepdim=True))


def newton_step(p: torch.Tensor, rows: torch.Tensor, length: torch.Tensor):
    """One Newton step on the row scaling of maps p (maps, n, n) with row sums `rows`, of `length` per map
    (model.newton_steps says why): (new maps, their row sums, their largest row errors)."""
    jac = torch.diag_embed(rows) - p @ p.mT + 1.0
    d = torch.linalg.solve_ex(jac, (1 - rows).unsqueeze(-1), check_errors=False)[0].squeeze(-1)
    q = p * torch.exp(length.unsqueeze(-1) * (d - d.amax(-1, keepdim=True))).unsqueeze(-1)
    q = q / q.sum(-2, keepdim=True)
    r = q.sum(-1)
    return q, r, (r - 1).abs().amax(-1)


def newton_fixed(p: torch.Tensor, steps: int, tol: float) -> torch.Tensor:
    """model.newton_steps on the maps p (maps, n, n) without selecting the maps still above tol: each step is
    computed for every map and taken where the map is above tol and the step lowers its largest row error
    (else that map halves its step length, as there). Returns the new maps."""
    rows = p.sum(-1)
    err = (rows - 1).abs().amax(-1)
    length = torch.ones_like(err)
    for _ in range(steps):
        live = err > tol
        q, r, e = newton_step(p, rows, length)
        take = live & (e < err)                         # (NaN compares false: a failed solve is not taken)
        p = torch.where(take[:, None, None], q, p)
        rows, err = torch.where(take[:, None], r, rows), torch.where(take, e, err)
        length = torch.where(take, 1.0, torch.where(live, length * 0.5, length))
    return p


def padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout_p: float,
                scale: float) -> torch.Tensor:
    """scaled_dot_product_attention of (B, H, T, dh) q, k, v with an additive (B, 1, T, T) bias, the head
    dimension padded with zeros to a multiple of 8 (the fused CUDA kernels need it): zero columns add nothing
    to q k^T and give zero output columns, which are cut off, so the result is the unpadded one."""
    dh = q.shape[-1]
    pad = (-dh) % 8
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p, scale=scale)
    return out[..., :dh] if pad else out

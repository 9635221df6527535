"""SASRec's full cross-entropy (loss.kind=ce): a softmax over the whole catalogue at every real position, its
[positions x items] logits never held at once; and the logits of shared negatives (loss.shared_negatives).

    loss = full_softmax_ce(h, weight, target, scale)   # h [N, D], weight [V, D], target [N] in [0, V)
    pos_logits, neg_logits, neg_valid = shared_logits(h, weight, pos, neg, neg_seen, "sequence", log_q)

The forward keeps, per position, only the log-sum-exp of its logits (computed a chunk of positions at a time);
the backward recomputes each chunk's logits and turns them into their gradient (softmax minus the target's one-hot)
there and then. Peak extra memory: a chunk's logits and their gradient, at most LOGITS float32 values each (the
chunk's positions follow the catalogue), against N x V for the plain product (batch 128 x maxlen 200 x 27k items:
2.8 GB in float32, 1.4 GB in bf16). `scale` weighs each position's loss (0 at padding, 1 / the real positions
elsewhere: the mean over real positions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.recipes.sasrec.model import length_groups

LOGITS = 2 ** 26       # a chunk's logits (and their gradient): at most this many, 256 MB in float32


def chunk_for(items: int) -> int:
    """Positions per chunk for a catalogue of `items`: 2,485 at 27k items, 67 at 1M."""
    return max(1, LOGITS // max(items, 1))


class _FullSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, scale, chunk):
        w = weight.to(h.dtype)                                      # (under autocast h may be bf16)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            # one [chunk x items] buffer per chunk, worked on in place: logsumexp's and the backward's temporaries
            # were three more, which a heap that keeps freed memory (native/memory.py) did not reuse across chunks
            # (4.8 GB at 100k items where the chunks allow 1.2)
            logits = (h[start:start + chunk] @ w.t()).float()
            top = logits.amax(-1, keepdim=True)
            lse[start:start + chunk] = logits.sub_(top).exp_().sum(-1).log_() + top.squeeze(-1)
            del logits                      # freed before the next chunk's is made, not after
        target_logit = (h.float() * weight[target].float()).sum(-1)
        ctx.save_for_backward(h, weight, target, scale, lse)
        ctx.chunk = chunk
        return (scale.float() * (lse - target_logit)).sum()

    @staticmethod
    def backward(ctx, grad):
        h, weight, target, scale, lse = ctx.saved_tensors
        w = scale.float() * grad                                    # each position's weight in the loss
        cast = weight.to(h.dtype)
        dh = torch.empty_like(h)
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, h.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            probs = (h[part] @ cast.t()).float().sub_(lse[part, None]).exp_().mul_(w[part, None])
            dh[part] = probs.to(h.dtype) @ cast
            dweight.addmm_(probs.t(), h[part].float())
            del probs
        dh -= (w[:, None] * weight[target].float()).to(h.dtype)    # the target's logit
        dweight.index_add_(0, target, -(w[:, None] * h.float()))
        return dh, dweight.to(weight.dtype), None, None, None


def full_softmax_ce(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                    chunk: int = 0) -> torch.Tensor:
    """sum over positions of scale * (logsumexp(h @ weight.T) - h . weight[target]), in chunks of positions
    (0: chunk_for the catalogue)."""
    return _FullSoftmaxCE.apply(h, weight, target, scale, int(chunk) or chunk_for(weight.shape[0]))


def shared_logits(h: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor,
                  neg_seen: torch.Tensor, mode: str, log_q: torch.Tensor | None = None):
    """(B, T) target logits, (B, T, K) logits of the shared negatives and (B, T, K) which of them count: not seen
    by the user (neg_seen) and not the position's own target. neg: (B, K) items, one row per sequence (sequence)
    or the same row for all (batch, in_batch: scored once against the whole batch). log_q: each item's log
    proposal probability, subtracted from every logit (logQ correction; None: uniform, nothing to correct)."""
    # rows by F.embedding, not weight[ids]: the same values, and a backward that sums the rows' gradients with
    # embedding's kernel instead of index_put_(accumulate=True), 2.3x slower on the CPU for Beauty's 128 x 3,000 rows
    pos_logits = (h * F.embedding(pos, weight)).sum(-1)
    if mode == "sequence":
        neg_logits = torch.bmm(h, F.embedding(neg, weight).transpose(1, 2))
    else:
        neg_logits = h @ F.embedding(neg[0], weight).t()
    if log_q is not None:
        pos_logits = pos_logits - log_q[pos].to(pos_logits.dtype)
        neg_logits = neg_logits - log_q[neg].to(neg_logits.dtype).unsqueeze(1)
    neg_valid = ~neg_seen.unsqueeze(1) & (neg.unsqueeze(1) != pos.unsqueeze(-1))
    return pos_logits, neg_logits, neg_valid


def real_shared_logits(h: torch.Tensor, weight: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                       neg: torch.Tensor, neg_seen: torch.Tensor, mode: str, log_q: torch.Tensor | None = None,
                       buckets: int = 4):
    """shared_logits of the real positions only (the CPU path): per length bucket of `seq` (model.length_groups)
    on its trimmed positions, then the real ones, concatenated: (N,) target logits, (N, K) negative logits, (N, K)
    which count, and the (N,) targets. The padded form scored every position against all K negatives: on
    Amazon Beauty (5.6 training positions per sequence in maxlen 50) 7.7x the real ones."""
    parts = []
    for rows, cut in length_groups(seq, buckets):
        r = slice(None) if rows is None else rows
        target = pos[r, cut:]
        real = target != 0
        logits = shared_logits(h[r, cut:], weight, target, neg[r], neg_seen[r], mode, log_q)
        parts.append((*(x[real] for x in logits), target[real]))
    return tuple(torch.cat(x) for x in zip(*parts))


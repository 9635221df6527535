"""SASRec (Kang & McAuley 2018), TiSASRec (Li et al. 2020) and mHC residual streams (arXiv 2512.24880).

    model = SeqRec(SeqRecConfig(time=True, mhc=True), num_items=3706, maxlen=200)
    pos_logits, neg_logits = model(seq, time, pos, neg)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class SeqRecConfig:
    """Model variant and sizes. time=False -> SASRec attention; mhc=False -> plain residuals."""

    hidden: int = 50
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.2
    norm: Literal["pre", "post"] = "pre"       # pre-LN (the maintained port) or post-LN (the paper)
    time: bool = True                          # TiSASRec time-interval aware attention
    time_span: int = 256                       # intervals are clipped at this many (rescaled) units
    mhc: bool = True                           # manifold-constrained hyper-connections
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    mhc_gate_init: float = 0.01
    mhc_fp32: bool = True                      # mHC maps in fp32 under AMP (the seed's --mhc_no_amp)
    loss: Literal["bce", "sampled_softmax"] = "bce"
    l2_emb: float = 0.0
    grad_checkpoint: bool = False


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly-stochastic projection of exp(logits) over the last two dims (rows, then columns)."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


class FeedForward(nn.Module):
    """Point-wise FFN (the papers' two 1x1 convolutions)."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.Dropout(p), nn.ReLU(), nn.Linear(d, d), nn.Dropout(p))

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        return self.net(x)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; with time=True the TiSASRec relation terms are added:
    scores += Q.E_K[r_ij] + Q.P_K[j], outputs += sum_j a_ij (E_V[r_ij] + P_V[j])."""

    def __init__(self, d: int, heads: int, p: float, maxlen: int, time: bool, time_span: int):
        super().__init__()
        if d % heads:
            raise ValueError(f"model.hidden={d} is not divisible by model.heads={heads}")
        self.h, self.dh, self.p, self.time = heads, d // heads, p, time
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        if time:
            self.pos_k, self.pos_v = nn.Embedding(maxlen, d), nn.Embedding(maxlen, d)
            self.time_k, self.time_v = nn.Embedding(time_span + 1, d), nn.Embedding(time_span + 1, d)
            self.emb_drop = nn.Dropout(p)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.dh).transpose(1, 2)          # (B, H, T, dh)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        drop = self.p if self.training else 0.0
        if not self.time:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        else:
            out = self._time_attention(q, k, v, mask, rel, drop)
        b, _, t, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(b, t, self.h * self.dh))

    def _time_attention(self, q, k, v, mask, rel, drop):
        t = q.shape[2]
        pos = torch.arange(t, device=q.device)
        pk = self.emb_drop(self.pos_k(pos)).view(t, self.h, self.dh)
        pv = self.emb_drop(self.pos_v(pos)).view(t, self.h, self.dh)
        ek = self.emb_drop(self.time_k.weight).view(-1, self.h, self.dh)  # (S+1, H, dh)
        ev = self.emb_drop(self.time_v.weight).view(-1, self.h, self.dh)
        idx = rel.unsqueeze(1).expand(-1, self.h, -1, -1)                 # (B, H, T, T)
        scores = q @ (k + pk.transpose(0, 1)).transpose(-1, -2)
        scores = scores + torch.einsum("bhtd,shd->bhts", q, ek).gather(-1, idx)
        scores = scores / math.sqrt(self.dh)
        attn = F.dropout(torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), drop, self.training)
        bins = torch.zeros(*attn.shape[:-1], ek.shape[0], dtype=attn.dtype, device=attn.device)
        bins.scatter_add_(-1, idx, attn)                                  # sum of a_ij per interval
        return attn @ (v + pv.transpose(0, 1)) + torch.einsum("bhts,shd->bhtd", bins, ev.to(attn.dtype))


class MHCMaps(nn.Module):
    """Per-token H_pre (1xn), H_post (1xn) and doubly-stochastic H_res (nxn) from the RMSNorm'd streams."""

    def __init__(self, n: int, d: int, cfg: SeqRecConfig):
        super().__init__()
        self.n, self.iters, self.fp32 = n, cfg.mhc_sinkhorn_iters, cfg.mhc_fp32
        self.norm = nn.RMSNorm(n * d)
        self.proj = nn.Linear(n * d, 2 * n + n * n, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02)
        self.alpha = nn.Parameter(torch.full((3,), cfg.mhc_gate_init))   # small gates: start near identity
        self.b_pre = nn.Parameter(torch.full((n,), math.log(1 / (n - 1)) if n > 1 else 10.0))  # H_pre = 1/n
        self.b_post = nn.Parameter(torch.zeros(n))                                             # H_post = 1
        self.b_res = nn.Parameter(torch.full((n, n), -4.0).fill_diagonal_(0.0))               # H_res ~ I

    def forward(self, x: torch.Tensor):
        if self.fp32 and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self._maps(x.float())
        return self._maps(x)

    def _maps(self, x: torch.Tensor):
        b, t, n, d = x.shape
        z = self.proj(self.norm(x.reshape(b, t, n * d)))
        pre = torch.sigmoid(self.alpha[0] * z[..., :n] + self.b_pre)
        post = 2 * torch.sigmoid(self.alpha[1] * z[..., n:2 * n] + self.b_post)
        res = sinkhorn(self.alpha[2] * z[..., 2 * n:].view(b, t, n, n) + self.b_res, self.iters)
        return pre, post, res


class Sublayer(nn.Module):
    """One residual sub-layer (attention or FFN) with a LayerNorm, as plain or mHC connection."""

    def __init__(self, fn: nn.Module, d: int, cfg: SeqRecConfig):
        super().__init__()
        self.fn, self.norm, self.pre_ln = fn, nn.LayerNorm(d, eps=1e-8), cfg.norm == "pre"
        self.maps = MHCMaps(cfg.mhc_streams, d, cfg) if cfg.mhc else None

    def forward(self, x: torch.Tensor, **kw) -> torch.Tensor:
        if self.maps is None:
            if self.pre_ln:
                return x + self.fn(self.norm(x), **kw)
            return self.norm(x + self.fn(x, **kw))
        pre, post, res = self.maps(x)                                    # x: (B, T, n, D) streams
        h = (pre.unsqueeze(-1).to(x.dtype) * x).sum(2)
        y = self.fn(self.norm(h), **kw)
        mixed = torch.einsum("btkj,btjd->btkd", res.to(x.dtype), x)
        return mixed + post.unsqueeze(-1).to(x.dtype) * y.unsqueeze(2)


class Block(nn.Module):
    """Attention then feed-forward sub-layer; padded positions are zeroed after each block."""

    def __init__(self, d: int, cfg: SeqRecConfig, maxlen: int):
        super().__init__()
        self.attn = Sublayer(SelfAttention(d, cfg.heads, cfg.dropout, maxlen, cfg.time, cfg.time_span), d, cfg)
        self.ffn = Sublayer(FeedForward(d, cfg.dropout), d, cfg)

    def forward(self, x, keep, mask, rel):
        x = self.attn(x, mask=mask, rel=rel)
        return self.ffn(x) * keep


class SeqRec(nn.Module):
    """Item embeddings -> blocks -> final LayerNorm; scores are dot products with item embeddings."""

    def __init__(self, cfg: SeqRecConfig, num_items: int, maxlen: int):
        super().__init__()
        self.cfg, self.maxlen = cfg, maxlen
        d = cfg.hidden
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = None if cfg.time else nn.Embedding(maxlen + 1, d, padding_idx=0)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(d, cfg, maxlen) for _ in range(cfg.blocks))
        self.last_norm = nn.LayerNorm(d, eps=1e-8)

    def _masks(self, seq: torch.Tensor, time: torch.Tensor):
        t = seq.shape[1]
        keep = (seq != 0).unsqueeze(-1)
        causal = torch.ones(t, t, dtype=torch.bool, device=seq.device).tril()
        # causal, no padded keys, but always the diagonal so a padded query has one key (no NaN)
        mask = (causal & (seq != 0).unsqueeze(1)) | torch.eye(t, dtype=torch.bool, device=seq.device)
        mask = mask.unsqueeze(1)                                        # (B, 1, T, T)
        rel = None
        if self.cfg.time:
            rel = (time.unsqueeze(2) - time.unsqueeze(1)).abs().clamp(max=self.cfg.time_span)
        return keep, mask, rel

    def features(self, seq: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """(B, T, D) representation of every prefix."""
        keep, mask, rel = self._masks(seq, time)
        x = self.item_emb(seq) * math.sqrt(self.cfg.hidden)
        if self.pos_emb is not None:
            positions = torch.arange(1, seq.shape[1] + 1, device=seq.device) * (seq != 0)
            x = x + self.pos_emb(positions)
        x = self.drop(x) * keep
        if self.cfg.mhc:
            x = x.unsqueeze(2).expand(-1, -1, self.cfg.mhc_streams, -1).contiguous()
            keep = keep.unsqueeze(2)
        for block in self.blocks:
            if self.cfg.grad_checkpoint and self.training:
                x = checkpoint(block, x, keep, mask, rel, use_reentrant=False)
            else:
                x = block(x, keep, mask, rel)
        if self.cfg.mhc:
            x = x.mean(2)                                                # collapse the streams once, at the end
        return self.last_norm(x)

    def forward(self, seq, time, pos, neg):
        """Training logits: (B, T) for the next items and (B, T, K) for the sampled negatives."""
        h = self.features(seq, time)
        pos_logits = (h * self.item_emb(pos)).sum(-1)
        neg_logits = torch.einsum("btd,btkd->btk", h, self.item_emb(neg))
        return pos_logits, neg_logits

    def score(self, seq, time, items: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of candidate items (B, C), or of every item (B, num_items + 1) when items is None."""
        h = self.features(seq, time)[:, -1]
        if items is None:
            return h @ self.item_emb.weight.t()
        return torch.einsum("bd,bcd->bc", h, self.item_emb(items))

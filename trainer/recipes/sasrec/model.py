"""SASRec (Kang & McAuley 2018), TiSASRec (Li et al. 2020) and mHC residual streams (arXiv 2512.24880).

    model = SeqRec(SeqRecConfig(time=True, mhc=True), num_items=3706, maxlen=200)
    pos_logits, neg_logits = model(seq, time, pos, neg)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.recipes.sasrec.config import SeqRecConfig


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly-stochastic projection of exp(logits) over the last two dims (rows, then columns)."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def keep_mask(x: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """Bernoulli(1-p) keep mask from four 15-bit fields of each random int64 word (random_ fills
    [0, 2^63), so the low 60 bits are uniform): a quarter of the RNG draws of torch.rand. p is
    quantised to 1/32768; the returned keep-scale 1/(1-p) uses the quantised value."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()
    fields = words.view(torch.int16)[:n].bitwise_and(0x7FFF)
    threshold = round(p * 32768)
    return fields.ge(threshold).view(x.shape), 32768 / (32768 - threshold)


class Dropout(nn.Module):
    """Inverted dropout with a cheap mask (see keep_mask): on CPU the RNG dominated the step, because
    the attention probabilities alone are B x H x T x T values per block."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep, scale = keep_mask(x, self.p)
        return x * keep * scale          # a bool multiply is ~2x faster than masked_fill on CPU

    def unscaled(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x with dropped entries zeroed, scale still to apply): lets attention scale its smaller output."""
        if not self.training or self.p == 0:
            return x, 1.0
        keep, scale = keep_mask(x, self.p)
        return x * keep, scale


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attention mask (True = attend) as an additive 0 / -inf bias."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class FeedForward(nn.Module):
    """Point-wise FFN (the papers' two 1x1 convolutions)."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), Dropout(p), nn.ReLU(), nn.Linear(d, d), Dropout(p))

    def forward(self, x: torch.Tensor, **_) -> torch.Tensor:
        return self.net(x)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; with time=True the TiSASRec relation terms are added:
    scores += Q.E_K[r_ij] + Q.P_K[j], outputs += sum_j a_ij (E_V[r_ij] + P_V[j])."""

    def __init__(self, d: int, heads: int, p: float, maxlen: int, time: bool, time_span: int):
        super().__init__()
        if d % heads:
            raise ValueError(f"model.width={d} is not divisible by model.heads={heads}")
        self.h, self.dh, self.time = heads, d // heads, time
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.attn_drop = Dropout(p)
        if time:
            self.pos_k, self.pos_v = nn.Embedding(maxlen, d), nn.Embedding(maxlen, d)
            self.time_k, self.time_v = nn.Embedding(time_span + 1, d), nn.Embedding(time_span + 1, d)
            self.emb_drop = Dropout(p)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.dh).transpose(1, 2)          # (B, H, T, dh)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rel: torch.Tensor | None = None,
                offset: int = 0) -> torch.Tensor:
        """mask: additive attention bias (0 / -inf), (B, 1, T, T), built once per forward; offset: how many
        leading (all-padding) positions were trimmed, so absolute positions stay those of the full length."""
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        if self.time:
            out = self._time_attention(q, k, v, mask, rel, offset)
        elif not self.training or self.attn_drop.p == 0:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))   # fused kernel
        else:  # explicit softmax so the fast dropout applies; mask added inside the matmul
            b, h, t, dh = q.shape
            bias = mask.to(q.dtype).expand(b, h, t, t).reshape(b * h, t, t)
            scores = torch.baddbmm(bias, (q * dh ** -0.5).reshape(b * h, t, dh), k.reshape(b * h, t, dh).mT)
            probs, scale = self.attn_drop.unscaled(torch.softmax(scores, -1))
            out = ((probs @ v.reshape(b * h, t, dh)) * scale).view(b, h, t, dh)
        b, _, t, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(b, t, self.h * self.dh))

    def _time_attention(self, q, k, v, mask, rel, offset):
        t = q.shape[2]
        pos = torch.arange(offset, offset + t, device=q.device)
        pk = self.emb_drop(self.pos_k(pos)).view(t, self.h, self.dh)
        pv = self.emb_drop(self.pos_v(pos)).view(t, self.h, self.dh)
        ek = self.emb_drop(self.time_k.weight).view(-1, self.h, self.dh)  # (S+1, H, dh)
        ev = self.emb_drop(self.time_v.weight).view(-1, self.h, self.dh)
        idx = rel.unsqueeze(1).expand(-1, self.h, -1, -1)                 # (B, H, T, T)
        scores = q @ (k + pk.transpose(0, 1)).transpose(-1, -2)
        scores = scores + torch.einsum("bhtd,shd->bhts", q, ek).gather(-1, idx)
        scores = scores / math.sqrt(self.dh)
        attn = self.attn_drop(torch.softmax(scores + mask.to(scores.dtype), -1))
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

    def forward(self, x, keep, mask, rel, offset):
        x = self.attn(x, mask=mask, rel=rel, offset=offset)
        return self.ffn(x) * keep


class SeqRec(nn.Module):
    """Item embeddings -> blocks -> final LayerNorm; scores are dot products with item embeddings."""

    def __init__(self, cfg: SeqRecConfig, num_items: int, maxlen: int):
        super().__init__()
        self.cfg, self.maxlen = cfg, maxlen
        d = cfg.width
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = None if cfg.time else nn.Embedding(maxlen + 1, d, padding_idx=0)
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(d, cfg, maxlen) for _ in range(cfg.depth))
        self.last_norm = nn.LayerNorm(d, eps=1e-8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-normal matrices as in both papers' code (PyTorch's N(0, 1) embeddings train far slower);
        the mHC maps keep their near-identity initialisation."""
        for name, param in self.named_parameters():
            if param.dim() >= 2 and ".maps." not in name:
                nn.init.xavier_normal_(param)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()
            if self.pos_emb is not None:
                self.pos_emb.weight[0].zero_()

    def _masks(self, seq: torch.Tensor, time: torch.Tensor):
        t = seq.shape[1]
        keep = (seq != 0).unsqueeze(-1)
        causal = torch.ones(t, t, dtype=torch.bool, device=seq.device).tril()
        # causal, no padded keys, but always the diagonal so a padded query has one key (no NaN)
        allowed = (causal & (seq != 0).unsqueeze(1)) | torch.eye(t, dtype=torch.bool, device=seq.device)
        mask = mask_bias(allowed.unsqueeze(1), torch.float32)          # (B, 1, T, T) additive 0 / -inf
        rel = None
        if self.cfg.time:
            rel = (time.unsqueeze(2) - time.unsqueeze(1)).abs().clamp(max=self.cfg.time_span)
        return keep, mask, rel

    def features(self, seq: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """(B, T, D) representation of every prefix (zeros at padded positions). Rows are processed in
        length buckets trimmed of their common left padding: padded keys are masked and positions keep
        their full-length index, so the result is the same as one padded batch, at a fraction of the cost."""
        buckets = self.cfg.length_buckets
        if buckets <= 1 or seq.shape[0] < 2 * buckets:
            return self._features(seq, time, 0)
        t = seq.shape[1]
        lengths = (seq != 0).sum(1)
        order = torch.argsort(lengths, descending=True)
        out = None
        for rows in order.chunk(buckets):
            cut = t - max(int(lengths[rows].max()), 1)
            h = self._features(seq[rows, cut:], time[rows, cut:], cut)
            if out is None:
                out = h.new_zeros(seq.shape[0], t, h.shape[-1])
            out = out.index_put((rows[:, None], torch.arange(cut, t, device=seq.device)[None, :]), h)
        return out

    def _features(self, seq: torch.Tensor, time: torch.Tensor, offset: int) -> torch.Tensor:
        keep, mask, rel = self._masks(seq, time)
        x = self.item_emb(seq) * math.sqrt(self.cfg.width)
        if self.pos_emb is not None:
            positions = torch.arange(offset + 1, offset + seq.shape[1] + 1, device=seq.device) * (seq != 0)
            x = x + self.pos_emb(positions)
        x = self.drop(x) * keep
        if self.cfg.mhc:
            x = x.unsqueeze(2).expand(-1, -1, self.cfg.mhc_streams, -1).contiguous()
            keep = keep.unsqueeze(2)
        for block in self.blocks:
            if self.cfg.grad_checkpoint and self.training:
                x = checkpoint(block, x, keep, mask, rel, offset, use_reentrant=False)
            else:
                x = block(x, keep, mask, rel, offset)
        if self.cfg.mhc:
            x = x.mean(2)                                                # collapse the streams once, at the end
        return self.last_norm(x) * (keep.squeeze(2) if self.cfg.mhc else keep)

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

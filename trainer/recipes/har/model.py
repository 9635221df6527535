"""Per-channel encoder shared by every channel, channel fusion, classifier head.

    model = HARNet(HARModelConfig(mode="flatten"), channels=9, length=128, classes=6)
    logits = model(x, lengths)        # x [B, 9, 128], lengths [B] -> [B, 6]

Fusion (`model.mode`, the seed's `--mode`): flatten concatenates the C channel embeddings (C x E features),
average takes their mean (E), first encodes channel 0 only (E; the other channels are never read).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipes.har.config import HARModelConfig


def valid_mask(lengths: torch.Tensor, size: int, full: int) -> torch.Tensor:
    """[B, size] True where a position of a length-`full` series downsampled to `size` holds real data."""
    keep = torch.ceil(lengths.float() * size / full).clamp(min=1)
    return torch.arange(size, device=lengths.device)[None, :] < keep[:, None]


def masked_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, D, T] -> [N, 2D]: mean and max over the valid positions."""
    m = mask[:, None, :].to(h.dtype)
    mean = (h * m).sum(-1) / m.sum(-1).clamp(min=1)
    peak = h.masked_fill(~mask[:, None, :], torch.finfo(h.dtype).min).amax(-1)
    return torch.cat([mean, peak], 1)


class CNNEncoder(nn.Module):
    """1-D conv blocks (conv, batch norm, ReLU, max-pool 2) over one channel, then masked mean+max pooling."""

    def __init__(self, cfg: HARModelConfig):
        super().__init__()
        blocks, c_in = [], 1
        for _ in range(cfg.depth):
            blocks += [nn.Conv1d(c_in, cfg.width, cfg.kernel_size, padding=cfg.kernel_size // 2, bias=False),
                       nn.BatchNorm1d(cfg.width), nn.ReLU(inplace=True), nn.MaxPool1d(2, ceil_mode=True)]
            c_in = cfg.width
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Linear(2 * cfg.width, cfg.channel_width)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """x [N, T], lengths [N] -> [N, E]."""
        h = self.blocks(x[:, None, :])
        return self.out(masked_pool(h, valid_mask(lengths, h.shape[-1], x.shape[-1])))


class PatchTransformerEncoder(nn.Module):
    """Non-overlapping patches of one channel, linear patch embedding + learned positions, a small
    pre-norm transformer with padding masked out, masked mean+max pooling."""

    def __init__(self, cfg: HARModelConfig, length: int):
        super().__init__()
        self.patch = cfg.patch
        self.embed = nn.Linear(cfg.patch, cfg.width)
        self.pos = nn.Parameter(torch.zeros(1, math.ceil(length / cfg.patch), cfg.width))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(cfg.width, cfg.heads, 2 * cfg.width, cfg.dropout, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False)
        self.out = nn.Linear(2 * cfg.width, cfg.channel_width)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """x [N, T], lengths [N] -> [N, E]."""
        t = x.shape[-1]
        x = F.pad(x, (0, (-t) % self.patch))
        tokens = self.embed(x.unflatten(-1, (-1, self.patch)))              # [N, P, W]
        tokens = tokens + self.pos[:, : tokens.shape[1]]
        mask = valid_mask(lengths, tokens.shape[1], x.shape[-1])
        h = self.blocks(tokens, src_key_padding_mask=~mask)
        return self.out(masked_pool(h.transpose(1, 2), mask))


class HARNet(nn.Module):
    """Shared per-channel encoder -> fusion -> dropout MLP head."""

    def __init__(self, cfg: HARModelConfig, channels: int, length: int, classes: int):
        super().__init__()
        self.cfg, self.channels = cfg, channels
        self.encoder = CNNEncoder(cfg) if cfg.encoder == "cnn" else PatchTransformerEncoder(cfg, length)
        fused = cfg.channel_width * (channels if cfg.mode == "flatten" else 1)
        if cfg.head_width > 0:
            self.head = nn.Sequential(nn.Dropout(cfg.dropout), nn.Linear(fused, cfg.head_width), nn.ReLU(inplace=True),
                                      nn.Dropout(cfg.dropout), nn.Linear(cfg.head_width, classes))
        else:
            self.head = nn.Sequential(nn.Dropout(cfg.dropout), nn.Linear(fused, classes))

    def fuse(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> the fused features: [B, C*E] (flatten) or [B, E] (average, first)."""
        if self.cfg.mode == "first":
            x = x[:, :1]
        b, c, t = x.shape
        emb = self.encoder(x.reshape(b * c, t), lengths.repeat_interleave(c)).view(b, c, -1)
        if self.cfg.mode == "flatten":
            return emb.flatten(1)
        return emb.mean(1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.fuse(x, lengths))

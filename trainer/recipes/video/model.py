"""3D CNNs for clip classification.

    model = Video3DCNN(VideoModelConfig(), in_channels=1, classes=8)
    logits = model(clips)              # float [B, C, T, H, W] -> [B, classes]

`mouse3d` is the seed's Mouse3DCNN: four Conv3d blocks (32/64/128/256, BatchNorm, ReLU), max-pooling
(1,2,2) after the first block and (2,2,2) after the others, global average pooling, FC 512 -> 256 ->
classes with dropout. `light` halves the widths and the head. `r3d_18` is torchvision's (weights=None).
`model.layout=frames` computes mouse3d/light with the same modules and weights as 2D convolutions over the frames
(frames_block): another order of the same sums, for GPUs whose 2D convolution kernels outrun their 3D ones.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.recipes.video.config import VideoModelConfig

WIDTHS = {"mouse3d": ((32, 64, 128, 256), (512, 256)), "light": ((16, 32, 64, 128), (256, 128))}


def block(c_in: int, c_out: int, pool: tuple[int, int, int]) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm3d(c_out),
                         nn.ReLU(inplace=True), WindowMaxPool3d(pool, ceil_mode=True))


class WindowMaxPool3d(nn.MaxPool3d):
    """nn.MaxPool3d over windows that do not overlap (kernel = stride, no padding), whose CUDA backward has no
    deterministic kernel: under torch.use_deterministic_algorithms on a CUDA tensor (train.deterministic) the
    same maxima come from window_max, whose backward is elementwise. Saved and loaded as nn.MaxPool3d (no state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.are_deterministic_algorithms_enabled() and self.stride == self.kernel_size \
                and not self.padding and self.dilation == 1:
            return window_max(x, self.kernel_size, self.ceil_mode)
        return super().forward(x)


def window_max(x: torch.Tensor, kernel: tuple[int, int, int], ceil_mode: bool) -> torch.Tensor:
    """max_pool3d(x, kernel) for stride = kernel as a reshape and amax. A tie splits its gradient among the tied
    inputs where max_pool3d gives it to one; behind a ReLU the tied ones are zeros, whose gradient the ReLU drops."""
    k = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
    size = x.shape[2:]
    if ceil_mode:       # the last window may run past the edge: -inf never wins a max
        x = torch.nn.functional.pad(x, (0, -size[2] % k[2], 0, -size[1] % k[1], 0, -size[0] % k[0]),
                                    value=float("-inf"))
    else:
        x = x[:, :, :size[0] // k[0] * k[0], :size[1] // k[1] * k[1], :size[2] // k[2] * k[2]]
    b, c, t, h, w = x.shape
    return x.reshape(b, c, t // k[0], k[0], h // k[1], k[1], w // k[2], k[2]).amax(dim=(3, 5, 7))


def frames_block(block: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A conv3d block (Conv3d 3x3x3 padding 1, BatchNorm3d, ReLU, WindowMaxPool3d) on frames: x is [B, T, C, H, W]
    (frame-major), the result too. The 3D convolution is one 2D convolution of the B*T frames over their three
    temporal taps stacked as channels (frame t-1, t, t+1; zeros past the ends, as Conv3d's padding), with the
    Conv3d's own weight laid out as [out, tap x in, kh, kw]: the same products and sums in another order. Batch
    norm over the B*T frames is BatchNorm3d's (the same mean and variance per channel, the same running stats)."""
    conv, norm, _, pool = block
    b, t, c, h, w = x.shape
    padded = F.pad(x, (0, 0, 0, 0, 0, 0, 1, 1))                    # the time axis (dim 1), one zero frame each side
    taps = torch.cat([padded[:, k:k + t] for k in range(3)], dim=2).reshape(b * t, 3 * c, h, w)
    weight = conv.weight.transpose(1, 2).reshape(conv.out_channels, 3 * c, *conv.kernel_size[1:])
    y = F.conv2d(taps, weight, None, 1, conv.padding[1:])
    y = F.batch_norm(y, norm.running_mean, norm.running_var, norm.weight, norm.bias,
                     norm.training or not norm.track_running_stats, _bn_momentum(norm), norm.eps)
    if norm.training and norm.track_running_stats:
        norm.num_batches_tracked.add_(1)
    y = F.relu(y)
    kt, kh, kw = pool.kernel_size
    if (kh, kw) != (1, 1):
        y = window_max(y.unsqueeze(2), (1, kh, kw), pool.ceil_mode).squeeze(2) \
            if y.is_cuda and torch.are_deterministic_algorithms_enabled() else \
            F.max_pool2d(y, (kh, kw), (kh, kw), ceil_mode=pool.ceil_mode)
    y = y.reshape(b, t, *y.shape[1:])
    if kt > 1:                                                      # the time axis's windows: a max over frame pairs
        if pool.ceil_mode and t % kt:
            y = F.pad(y, (0, 0, 0, 0, 0, 0, 0, kt - t % kt), value=float("-inf"))
        else:
            y = y[:, :t // kt * kt]
        y = y.reshape(b, y.shape[1] // kt, kt, *y.shape[2:]).amax(dim=2)
    return y


def _bn_momentum(norm: nn.BatchNorm3d) -> float:
    """The momentum BatchNorm's own forward passes (None: a cumulative average, as nn.BatchNorm does)."""
    if norm.momentum is not None:
        return norm.momentum
    return 1.0 / float(norm.num_batches_tracked + 1) if norm.training and norm.track_running_stats else 0.0


class Video3DCNN(nn.Module):
    """Conv3d blocks -> global average pool -> MLP head."""

    def __init__(self, cfg: VideoModelConfig, in_channels: int, classes: int):
        super().__init__()
        self.cfg = cfg
        widths, fc = WIDTHS[cfg.arch]
        chans = (in_channels, *widths)
        self.blocks = nn.ModuleList(block(chans[i], chans[i + 1], (1, 2, 2) if i == 0 else (2, 2, 2))
                                    for i in range(len(widths)))
        layers, prev = [], widths[-1]
        for width in fc:
            layers += [nn.Dropout(cfg.dropout), nn.Linear(prev, width), nn.ReLU(inplace=True)]
            prev = width
        self.head = nn.Sequential(*layers, nn.Dropout(cfg.dropout), nn.Linear(prev, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = getattr(self.cfg, "layout", "conv3d") == "frames"
        if frames:
            x = x.transpose(1, 2)                  # [B, T, C, H, W]: the frames are the 2D convolutions' batch
        for b in self.blocks:
            run = functools.partial(frames_block, b) if frames else b
            x = checkpoint(run, x, use_reentrant=False) if self.cfg.grad_checkpoint and self.training else run(x)
        return self.head(x.mean(dim=(1, 3, 4) if frames else (2, 3, 4)))


def build(cfg: VideoModelConfig, in_channels: int, classes: int) -> nn.Module:
    if cfg.arch != "r3d_18":
        return Video3DCNN(cfg, in_channels, classes)
    try:
        from torchvision.models.video import r3d_18
    except ImportError:
        raise ImportError("model.arch=r3d_18 needs torchvision (pip install torchvision matching your torch); "
                          "model.arch=mouse3d or light need nothing extra") from None
    model = r3d_18(weights=None, num_classes=classes)
    if in_channels != 3:
        stem = model.stem[0]
        model.stem[0] = nn.Conv3d(in_channels, stem.out_channels, stem.kernel_size, stem.stride, stem.padding,
                                  bias=False)
    return model


def train_flops_per_clip(model: nn.Module, clip_shape: tuple[int, int, int, int]) -> float:
    """FLOPs of one training sample (forward + backward = 3 x forward), counted with torch's FlopCounter."""
    from torch.utils.flop_counter import FlopCounterMode
    was = model.training
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, *clip_shape))
    model.train(was)
    return 3.0 * counter.get_total_flops()

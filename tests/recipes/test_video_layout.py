"""Issue 70 point 1, its CPU part: `model.layout=frames` (trainer/recipes/video/model.py frames_block) computes the
seed's model with the same modules and weights as 2D convolutions over the frames. Checked against the Conv3d
layout on the CPU: the logits, every parameter's gradient and BatchNorm's running statistics agree within float
rounding, in training and in evaluation, for an odd clip length (ceil-mode pooling in time), with gradient
checkpointing, and a checkpoint of either layout loads into the other. Its speed is a GPU's question (issue 70)."""
from __future__ import annotations

import pytest
import torch

from trainer.recipes.video.config import VideoModelConfig
from trainer.recipes.video.model import Video3DCNN


def pair(arch: str, dropout: float = 0.0, grad_checkpoint: bool = False):
    torch.manual_seed(0)
    plain = Video3DCNN(VideoModelConfig(arch=arch, dropout=dropout, grad_checkpoint=grad_checkpoint), 1, 5)
    frames = Video3DCNN(VideoModelConfig(arch=arch, dropout=dropout, grad_checkpoint=grad_checkpoint,
                                         layout="frames"), 1, 5)
    frames.load_state_dict(plain.state_dict())             # the same modules: a checkpoint of one loads into the other
    return plain, frames


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = a.abs().max().clamp_min(1e-6)
    assert (a - b).abs().max() <= 1e-4 * scale, f"{what}: {(a - b).abs().max():.3g} against {scale:.3g}"


@pytest.mark.parametrize("arch,grad_checkpoint", [("light", False), ("mouse3d", False), ("light", True)])
def test_the_frames_layout_is_the_conv3d_model_in_logits_gradients_and_running_stats(arch, grad_checkpoint):
    plain, frames = pair(arch, grad_checkpoint=grad_checkpoint)
    clips = torch.randn(3, 1, 9, 20, 20)                    # T=9: ceil-mode pooling in time (9 -> 5 -> 3 -> 2)
    for step in range(2):                                   # the second step sees the first's running stats
        outs = [m(clips) for m in (plain, frames)]
        close(outs[0], outs[1], f"logits, step {step}")
        for m, out in zip((plain, frames), outs):
            m.zero_grad()
            torch.nn.functional.cross_entropy(out, torch.tensor([0, 3, 4])).backward()
        for (name, a), b in zip(plain.named_parameters(), frames.parameters()):
            close(a.grad, b.grad, f"gradient of {name}")
    for (name, a), b in zip(plain.named_buffers(), frames.buffers()):
        assert torch.equal(a, b) if name.endswith("num_batches_tracked") else True
        if a.is_floating_point():
            close(a, b, name)
    plain.eval()
    frames.eval()
    with torch.no_grad():
        close(plain(clips), frames(clips), "logits in evaluation")


def test_dropout_draws_alike_in_both_layouts():
    plain, frames = pair("light", dropout=0.5)
    clips = torch.randn(2, 1, 5, 16, 16)
    torch.manual_seed(7)
    a = plain(clips)
    torch.manual_seed(7)
    close(a, frames(clips), "logits with dropout")

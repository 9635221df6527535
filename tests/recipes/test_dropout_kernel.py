"""The hash-mask dropout kernel (trainer/recipes/dropout_kernels.inc, used by trainer/recipes/dropout.py on float32 CPU
tensors): keep_mask's rate and scale, the backward's mask is the forward's, torch.manual_seed fixes it, and
gradient checkpointing recomputes the same mask."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainer.recipes import dropout as DR
from trainer.recipes import kernels
from trainer.recipes.dropout import Dropout


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_kernel_dropout_rate_scale_and_gradient(ops, p, monkeypatch):
    calls = []
    real = DR._HashDropout.apply
    monkeypatch.setattr(DR._HashDropout, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(400_000, requires_grad=True)
    y = Dropout(p).train()(x)
    assert calls, "the kernel path was not taken"
    kept = y != 0
    factor = 32768 / (32768 - round(p * 32768))
    assert abs(kept.float().mean().item() - (1 - p)) < 4e-3
    assert torch.allclose(y[kept], x.detach()[kept] * factor)
    weights = torch.randn_like(x)
    (y * weights).sum().backward()
    assert torch.equal(x.grad != 0, kept & (weights != 0))           # the backward's mask is the forward's
    assert torch.allclose(x.grad[kept], weights[kept] * factor)


def test_kernel_dropout_masks_follow_the_seed_and_differ_per_call(ops):
    d, x = Dropout(0.3).train(), torch.ones(10_000)
    torch.manual_seed(5)
    a, b = d(x), d(x)
    torch.manual_seed(5)
    assert torch.equal(d(x), a) and not torch.equal(a, b)
    dropped, factor = d.unscaled(x)                                  # attention's form: the scale returned
    assert factor == pytest.approx(32768 / (32768 - round(0.3 * 32768))) and set(dropped.unique().tolist()) <= {0, 1}


def test_kernel_dropout_under_checkpointing_recomputes_the_same_mask(ops):
    torch.manual_seed(6)
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), Dropout(0.4), torch.nn.Linear(32, 8)).train()
    x = torch.randn(64, 32)
    torch.manual_seed(7)
    layer(x).square().sum().backward()
    plain = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.manual_seed(7)
    checkpoint(layer, x, use_reentrant=False).square().sum().backward()
    for a, b in zip(plain, (p.grad for p in layer.parameters())):
        assert torch.allclose(a, b)


def test_without_kernels_dropout_keeps_its_pytorch_mask(monkeypatch):
    monkeypatch.setattr(kernels._EXT, "_ops", None)
    monkeypatch.setattr(kernels._EXT, "_tried", True)
    x = torch.ones(200_000, requires_grad=True)
    y = Dropout(0.2).train()(x)
    assert abs((y != 0).float().mean().item() - 0.8) < 5e-3
    y.sum().backward()
    assert torch.equal(x.grad != 0, y != 0)

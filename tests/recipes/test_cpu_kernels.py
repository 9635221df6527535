"""The dropout and LayerNorm kernels of trainer/recipes/kernels.cpp (float32 CPU tensors). Dropout: keep_mask's
rate and scale, the backward's mask is the forward's, torch.manual_seed fixes it, gradient checkpointing
recomputes the same mask. LayerNorm: nn.LayerNorm's outputs and gradients and state_dict."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainer.recipes import dropout as DR
from trainer.recipes import kernels
from trainer.recipes.dropout import Dropout
from trainer.recipes.layer_norm import LayerNorm


@pytest.fixture(scope="module")
def ops():
    module = kernels.load()
    if module is None:
        print(f"SKIP: CPU kernels not built here: {kernels.unavailable_reason()}")
        pytest.skip(f"CPU kernels not built here: {kernels.unavailable_reason()}")
    return module


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
    monkeypatch.setattr(kernels, "_state", {"ops": None, "why": "test"})
    x = torch.ones(200_000, requires_grad=True)
    y = Dropout(0.2).train()(x)
    assert abs((y != 0).float().mean().item() - 0.8) < 5e-3
    y.sum().backward()
    assert torch.equal(x.grad != 0, y != 0)


@pytest.mark.parametrize("width", [50, 7, 64])
def test_kernel_layer_norm_is_nn_layer_norm(ops, width, monkeypatch):
    torch.manual_seed(width)
    ref, ours = torch.nn.LayerNorm(width, eps=1e-8), LayerNorm(width, eps=1e-8)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    ours.load_state_dict(ref.state_dict())                  # same parameters, same keys
    calls = []
    real = ops.layer_norm_backward
    monkeypatch.setattr(kernels, "_state", {"ops": _Spy(ops, calls), "why": ""})
    x = (3 * torch.randn(37, 11, width) + 1).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(37, 11, width)
    ref(x).backward(g)
    out = ours(x2)
    out.backward(g)
    assert calls == ["layer_norm_backward"] and real is ops.layer_norm_backward
    assert torch.allclose(out, ref(x), atol=1e-6)
    assert torch.allclose(x2.grad, x.grad, atol=1e-5)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)
    assert torch.allclose(ours.bias.grad, ref.bias.grad, atol=1e-4, rtol=1e-5)


class _Spy:
    def __init__(self, ops, calls):
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._ops, name)


def test_layer_norm_without_gradients_or_kernels_is_plain(monkeypatch):
    ref, ours = torch.nn.LayerNorm(16), LayerNorm(16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    monkeypatch.setattr(kernels, "_state", {"ops": None, "why": "test"})
    assert ours(x).grad_fn.name() == ref(x).grad_fn.name()

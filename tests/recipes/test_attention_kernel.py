"""SASRec's training attention as one C++ kernel (sasrec/attention_kernels.inc `attention`, model.attention_fused): the
PyTorch path's function (causal, padded keys masked, a padded query sees itself) with the hash-mask dropout,
its gradients, the dropout rate, the seed, and the model with and without it."""
from __future__ import annotations

import pytest
import torch

from tests.timeouts import limit
from trainer.recipes.sasrec import fused
from trainer.recipes.sasrec.config import SeqRecConfig
from trainer.recipes.sasrec.model import Packing, SeqRec, attention_bias

M32 = 0xFFFFFFFF


def fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def keep_reference(bh: int, t: int, seed: int, threshold: int) -> torch.Tensor:
    """The kernel's dropout mask, from its formula: element (bh, i, j) is counter (bh T + i) T + j."""
    base = (seed & M32) ^ ((seed >> 32) & M32)
    counter = torch.arange(bh * t * t, dtype=torch.int64).view(bh, t, t) & M32
    return (fmix32((counter * 0x9E3779B9 + base) & M32) >> 17) >= threshold


def batch(t: int = 70):
    lengths = torch.tensor([70, 41, 5, 0])
    seq = torch.where(torch.arange(t) >= t - lengths[:, None], torch.randint(1, 9, (4, t)), 0)
    seq[0, 30] = 0                                  # a padded key inside a sequence
    return seq


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5])
def test_kernel_equals_the_masked_softmax_on_the_real_positions(ops, p):
    """The packed kernel's output and gradients at the real positions equal the padded batch's masked softmax
    attention there, with the kernel's dropout mask applied at the real positions' own (row, i, j)."""
    torch.manual_seed(0)
    heads, seq = 2, batch()
    b, t, dh = *seq.shape, 8
    packing = Packing(seq)
    q, k, v = (torch.randn(b, t, heads, dh, requires_grad=True) for _ in range(3))
    threshold, seed, scale = round(p * 32768), 1234567890123, dh ** -0.5
    factor = 32768 / (32768 - threshold)
    qkv = packing.pack(torch.stack([q, k, v], 2)).detach().contiguous()            # (N, 3, H, dh)
    out, lse = ops.attention(qkv, packing.starts, t, scale, seed, threshold, factor)
    # the mask over (row, head, i, j) of each row's real positions, spread to the padded batch's (i, j)
    keep = torch.ones(b, heads, t, t, dtype=torch.bool)
    real = [torch.nonzero(seq[r]).squeeze(1) for r in range(b)]
    drawn = keep_reference(b * heads, t, seed, threshold).view(b, heads, t, t)
    for r in range(b):
        n = len(real[r])
        keep[r][:, real[r][:, None], real[r][None, :]] = drawn[r][:, :n, :n]
    probs = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).mT * scale + attention_bias(seq), -1)
    ref = ((probs * keep) @ v.transpose(1, 2)).transpose(1, 2) * factor          # (B, T, H, dh)
    assert torch.allclose(out, packing.pack(ref), atol=1e-5), (out - packing.pack(ref)).abs().max()
    g = torch.randn_like(out)
    got = ops.attention_backward(g, qkv, packing.starts, lse, t, scale, seed, threshold, factor)
    want = torch.stack(torch.autograd.grad(packing.pack(ref), [q, k, v], g), 2)
    assert torch.allclose(got, packing.pack(want), atol=1e-4), (got - packing.pack(want)).abs().max()
    if p:
        assert abs((~drawn).float().mean().item() - p) < 0.02


def test_bad_offsets_are_refused(ops):
    qkv = torch.zeros(5, 3, 1, 4)
    with pytest.raises(RuntimeError, match="do not cover the 5 tokens"):
        ops.attention(qkv, torch.tensor([0, 3]), 8, 1.0, 0, 0, 1.0)
    with pytest.raises(RuntimeError, match="at most T = 4"):
        ops.attention(qkv, torch.tensor([0, 5]), 4, 1.0, 0, 0, 1.0)


def test_the_dropout_rate_and_the_seed(ops):
    torch.manual_seed(0)
    qkv = torch.randn(1600, 3, 1, 4)
    qkv[:, 2] = 1.0
    starts = torch.arange(0, 1601, 200)
    run = lambda: fused.FusedAttention.apply(qkv, starts, 200, 0.5, round(0.2 * 32768), 1.25)   # noqa: E731
    torch.manual_seed(3)
    a = run()
    torch.manual_seed(3)
    assert torch.equal(run(), a)                    # torch.manual_seed fixes the mask
    assert not torch.equal(run(), a)                # a fresh mask per call
    # values of ones: each output is 1.25 x the kept probability mass, 0.8 of it on average
    assert abs(a.mean().item() - 1.0) < 0.02


def _model(fused_kernel: bool, dropout: float, **kw) -> SeqRec:
    torch.manual_seed(4)
    cfg = SeqRecConfig(**{"width": 16, "heads": 2, "time": False, "mhc": False, "dropout": dropout,
                          "attention_fused": fused_kernel, **kw})
    return SeqRec(cfg, num_items=30, maxlen=70).train()


def _loss_and_grads(model, seq):
    pos, neg = seq.roll(-1, 1), (seq * 7 + 3) % 30 + 1
    p, n = model(seq, torch.zeros_like(seq), pos, neg.unsqueeze(-1))
    loss = (p.square().sum() + n.square().sum()) * 1e-3
    return loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("mhc,kw", [(False, {}), (True, {}), (False, dict(norm="original", positions="from_start"))],
                         ids=["sasrec", "mhc", "original-block"])
def test_the_model_with_the_kernel_computes_the_pytorch_paths_function(ops, mhc, kw, monkeypatch):
    """Nothing dropped (p below the mask's resolution): the kernel's model and the PyTorch path's agree in
    loss and every gradient; the kernel really ran (model.norm=original too: its keys and values from the raw
    input, its queries from the normalised one)."""
    calls = []
    real = fused.FusedAttention.apply
    monkeypatch.setattr(fused.FusedAttention, "apply", lambda *a: calls.append(1) or real(*a))
    seq = batch()
    kernel_model = _model(True, 1e-9, mhc=mhc, length_buckets=2, **kw)
    assert kernel_model.packs(seq)                      # one packed batch, mHC too: no length buckets
    loss_k, grads_k = _loss_and_grads(kernel_model, seq)
    assert len(calls) == kernel_model.cfg.depth
    calls.clear()
    loss_p, grads_p = _loss_and_grads(_model(False, 1e-9, mhc=mhc, length_buckets=2, **kw), seq)
    assert not calls
    assert torch.allclose(loss_k, loss_p, rtol=1e-5)
    for a, b in zip(grads_k, grads_p):
        if a is not None:
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def test_gradient_checkpointing_recomputes_the_same_mask(ops):
    seq, plain_model, model = batch(), _model(True, 0.3), _model(True, 0.3, grad_checkpoint=True)
    torch.manual_seed(9)
    plain = _loss_and_grads(plain_model, seq)
    torch.manual_seed(9)
    again = _loss_and_grads(model, seq)
    assert torch.allclose(plain[0], again[0])
    for a, b in zip(plain[1], again[1]):
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6)


def test_the_aten_path_computes_what_the_blas_path_does(ops, tmp_path):
    """Where torch's library exports no sgemm_ the kernel's products go through ATen's addmm: forced here with
    TRAINER_KERNEL_SGEMM=0 in a fresh process, the same outputs and gradient."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import torch\nfrom trainer.recipes import kernels\nops = kernels.load()\nassert not ops.has_blas()\n"
            "torch.manual_seed(0)\nqkv = torch.randn(130, 3, 2, 8)\nst = torch.tensor([0, 70, 100, 100, 130])\n"
            "out, lse = ops.attention(qkv, st, 70, 0.3, 11, 6554, 1.25)\n"
            "g = ops.attention_backward(out, qkv, st, lse, 70, 0.3, 11, 6554, 1.25)\n"
            f"torch.save((out, g), {str(tmp_path / 'aten.pt')!r})\n")
    env = {**__import__("os").environ, "TRAINER_KERNEL_SGEMM": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not ops.has_blas():
        print("NOTE: torch's library here exports no sgemm_: both processes took ATen's path")
    torch.manual_seed(0)
    qkv, st = torch.randn(130, 3, 2, 8), torch.tensor([0, 70, 100, 100, 130])
    out, lse = ops.attention(qkv, st, 70, 0.3, 11, 6554, 1.25)
    g = ops.attention_backward(out, qkv, st, lse, 70, 0.3, 11, 6554, 1.25)
    aten_out, aten_g = torch.load(tmp_path / "aten.pt", weights_only=True)
    assert torch.allclose(out, aten_out, atol=1e-5) and torch.allclose(g, aten_g, atol=1e-5)

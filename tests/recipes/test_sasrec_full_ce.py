"""Issue 71 point 1 (`loss.kind=ce`), its first part: the full softmax cross-entropy over the catalogue, chunked
over positions (trainer/recipes/sasrec/losses.py), against the plain product on tiny data: values and gradients,
any chunk, padding positions weighed 0; and the chunk sized by the catalogue."""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import assert_bitwise_equal, run_ranks, weights
from tests.inprocess import cli
from trainer.recipes.sasrec.losses import LOGITS, chunk_for, full_softmax_ce


def reference(h, weight, target, scale):
    logits = h @ weight.t()
    return (scale * (torch.logsumexp(logits, -1) - logits.gather(1, target[:, None])[:, 0])).sum()


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_the_chunked_loss_and_its_gradients_are_the_plain_products(chunk):
    torch.manual_seed(0)
    h = torch.randn(11, 5, requires_grad=True)
    weight = torch.randn(9, 5, requires_grad=True)
    target = torch.randint(0, 9, (11,))
    scale = torch.rand(11)
    scale[[2, 5]] = 0.0                                     # padding positions
    ours = full_softmax_ce(h, weight, target, scale, chunk)
    ours.backward()
    got = (h.grad.clone(), weight.grad.clone())
    h.grad = weight.grad = None
    ref = reference(h, weight, target, scale)
    ref.backward()
    assert torch.allclose(ours, ref, atol=1e-5), (ours, ref)
    assert torch.allclose(got[0], h.grad, atol=1e-5) and torch.allclose(got[1], weight.grad, atol=1e-5)
    assert torch.all(got[0][[2, 5]] == 0)                   # padding contributes nothing


def test_a_repeated_target_accumulates_its_gradient_rows():
    torch.manual_seed(1)
    h = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(3, 4, requires_grad=True)
    target = torch.tensor([1, 1, 1, 0, 2, 1])
    scale = torch.full((6,), 1 / 6)
    full_softmax_ce(h, weight, target, scale, 2).backward()
    mine = weight.grad.clone()
    weight.grad = None
    reference(h, weight, target, scale).backward()
    assert torch.allclose(mine, weight.grad, atol=1e-6)


def test_the_chunk_follows_the_catalogue():
    assert chunk_for(27_000) * 27_000 <= LOGITS < (chunk_for(27_000) + 1) * 27_000
    assert chunk_for(1_000_000) == 67 and chunk_for(10**9) == 1


CE = ("train", "--recipe", "sasrec", "loss.kind=ce", "log.tensorboard=false", "data.synthetic_users=120",
      "data.synthetic_items=200", "model.mhc=false", "model.time=false")


def test_two_ddp_ranks_train_with_ce_and_a_resume_ends_bitwise_equal(tmp_path):
    """Through DDP (the features come through its forward, the item table's use in the loss joins the same
    gradient) and a resume after the first of two epochs, bitwise equal to the uninterrupted run."""
    run_ranks(2, *CE, "--epochs", "1", "--run-dir", str(tmp_path / "ddp"))
    assert (tmp_path / "ddp" / "checkpoints" / "final.pt").exists()
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cli(*CE, "--epochs", "2", "ckpt.every_steps=3", "ckpt.keep_last=0", "--run-dir", str(whole))
    (parts / "checkpoints").mkdir(parents=True)
    shutil.copy(whole / "checkpoints" / "step-00000003.pt", parts / "checkpoints")   # mid-epoch
    cli(*CE, "--epochs", "2", "--resume", "auto", "--run-dir", str(parts))
    assert_bitwise_equal(weights(parts), weights(whole))

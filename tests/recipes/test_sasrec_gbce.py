"""Issue 71 point 1 (`loss.kind=gbce`): gSASRec's calibrated BCE against its authors' own formulation on tiny data
(the positive logit transformed so that its sigmoid is sigmoid(s)^beta, then a plain BCE averaged over every
positive and negative term of the real positions), values and gradients; beta from the sampling rate and t."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.inprocess import cli
from trainer.recipes.sasrec.recipe import gbce_beta, sequence_loss


def gsasrec(pos_logits, neg_logits, pos, beta):
    """gSASRec's code (gsasrec.py, its loss): the transformed positive, BCEWithLogits, the mean over the mask."""
    eps = 1e-10
    positive_probs = torch.clamp(torch.sigmoid(pos_logits.double()), eps, 1 - eps)
    adjusted = torch.clamp(positive_probs.pow(-beta), 1 + eps, torch.finfo(torch.float64).max)
    transformed = torch.clamp(1.0 / (adjusted - 1), eps, torch.finfo(torch.float64).max).log()
    logits = torch.cat([transformed.unsqueeze(-1), neg_logits.double()], -1)
    truth = torch.zeros_like(logits)
    truth[..., 0] = 1
    mask = (pos != 0).unsqueeze(-1).expand_as(logits).double()
    return (F.binary_cross_entropy_with_logits(logits, truth, reduction="none") * mask).sum() / mask.sum()


def test_gbce_is_gsasrecs_loss_in_value_and_gradient():
    torch.manual_seed(0)
    pos_logits = torch.randn(3, 5, requires_grad=True)
    neg_logits = torch.randn(3, 5, 4, requires_grad=True)
    pos = torch.tensor([[0, 0, 3, 4, 5], [0, 1, 2, 3, 4], [7, 8, 9, 1, 2]])
    beta = gbce_beta(4, 1000, 0.75)
    ours = sequence_loss(pos_logits, neg_logits, pos, "gbce", beta)
    ours.backward()
    grads = (pos_logits.grad.clone(), neg_logits.grad.clone())
    pos_logits.grad = neg_logits.grad = None
    theirs = gsasrec(pos_logits, neg_logits, pos, beta)
    theirs.backward()
    assert abs(float(ours) - float(theirs)) < 1e-5, (float(ours), float(theirs))
    assert torch.allclose(grads[0], pos_logits.grad.float(), atol=1e-6)
    assert torch.allclose(grads[1], neg_logits.grad.float(), atol=1e-6)


def test_beta_is_one_at_t_0_and_the_sampling_rate_at_t_1():
    assert gbce_beta(256, 3417, 0.0) == pytest.approx(1.0)
    assert gbce_beta(256, 3417, 1.0) == pytest.approx(256 / 3416)
    assert gbce_beta(256, 3417, 0.75) == pytest.approx(256 / 3416 * (0.75 * (1 - 3416 / 256) + 3416 / 256))


def test_sasrec_trains_with_gbce(tmp_path):
    out = cli("train", "--recipe", "sasrec", "loss.kind=gbce", "data.train_negatives=8", "--epochs", "1",
                  "log.tensorboard=false", "data.synthetic_users=120", "data.synthetic_items=200",
                  "model.mhc=false", "model.time=false", "--run-dir", str(tmp_path / "run"))
    assert "val after epoch 0" in out.stderr and (tmp_path / "run" / "checkpoints" / "final.pt").exists()

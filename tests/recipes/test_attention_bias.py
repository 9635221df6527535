"""The attention bias built by one broadcast add equals the boolean-mask construction it replaced."""
import torch

from trainer.recipes.sasrec.model import attention_bias, causal_bias


def reference_bias(seq: torch.Tensor) -> torch.Tensor:
    t = seq.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    allowed = (causal & (seq != 0).unsqueeze(1)) | torch.eye(t, dtype=torch.bool)
    return torch.zeros(allowed.unsqueeze(1).shape).masked_fill_(~allowed.unsqueeze(1), float("-inf"))


def test_the_bias_is_causal_masks_padded_keys_and_keeps_the_diagonal():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, 9, (6, 37), generator=g)
    for row, pad in enumerate([0, 5, 36, 37, 1, 20]):      # a full row, short ones, an all-padding one
        seq[row, :pad] = 0
    bias = attention_bias(seq)
    assert bias.shape == (6, 1, 37, 37) and torch.equal(bias, reference_bias(seq))
    assert torch.isfinite(torch.softmax(bias, -1)).all()    # every query keeps a key: no NaN
    assert torch.equal(attention_bias(seq), bias)           # the cached causal part was not written into
    assert causal_bias(37, seq.device) is causal_bias(37, seq.device)

"""HAR model: the three fusion modes' shapes, `first` never reads the other channels, padding is masked,
and throughput counts windows (not channel series)."""

import pytest
import torch

from trainer.engine.capabilities import Batching, of
from trainer.recipes.har.config import HARLossConfig
from trainer.recipes.har.model import HARModelConfig, HARNet, masked_pool, valid_mask

B, C, T, E, K = 5, 9, 128, 16, 6


def net(**kw):
    torch.manual_seed(0)
    cfg = HARModelConfig(channel_width=E, width=8, head_width=12, **kw)
    return HARNet(cfg, C, T, K).eval()


@pytest.mark.parametrize("encoder", ["cnn", "transformer"])
@pytest.mark.parametrize("mode,features", [("flatten", C * E), ("average", E), ("first", E)])
def test_fusion_modes_have_the_documented_shapes(mode, features, encoder):
    model = net(mode=mode, encoder=encoder, patch=16, heads=2)
    x, lengths = torch.randn(B, C, T), torch.full((B,), T)
    assert model.fuse(x, lengths).shape == (B, features)
    assert model(x, lengths).shape == (B, K)
    assert model.head[1].in_features == features


@pytest.mark.parametrize("encoder", ["cnn", "transformer"])
def test_first_ignores_the_other_channels_and_average_ignores_their_order(encoder):
    x, lengths = torch.randn(B, C, T), torch.full((B,), T)
    first = net(mode="first", encoder=encoder)
    y = x.clone()
    y[:, 1:] = torch.randn(B, C - 1, T) * 10
    assert torch.equal(first(x, lengths), first(y, lengths))
    y[:, 0] += 1
    assert not torch.allclose(first(x, lengths), first(y, lengths))
    perm = torch.randperm(C)
    avg, flat = net(mode="average", encoder=encoder), net(mode="flatten", encoder=encoder)
    torch.testing.assert_close(avg(x, lengths), avg(x[:, perm], lengths), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(flat(x, lengths), flat(x[:, perm], lengths), atol=1e-3)


def test_masked_pooling_ignores_padding():
    mask = valid_mask(torch.tensor([128, 64, 1]), 16, 128)
    assert mask.sum(1).tolist() == [16, 8, 1]
    h = torch.randn(3, 4, 16)
    g = h.clone()
    g[~mask[:, None, :].expand_as(g)] = 1e6                                  # garbage in the padding
    torch.testing.assert_close(masked_pool(h, mask), masked_pool(g, mask))
    torch.testing.assert_close(masked_pool(h, mask)[1, :4], h[1, :, :8].mean(-1))


def test_transformer_padding_beyond_the_length_changes_nothing():
    model = net(encoder="transformer", patch=16, heads=2)
    x, lengths = torch.randn(B, C, T), torch.tensor([128, 64, 32, 96, 16])
    y = x.clone()
    for i, n in enumerate(lengths.tolist()):
        y[i, :, n:] = torch.randn(C, T - n) * 100
    torch.testing.assert_close(model(x, lengths), model(y, lengths), atol=1e-5, rtol=1e-5)


def test_label_smoothing_and_throughput_counts_windows():
    from trainer.recipes.har.recipe import HARRecipe
    recipe = HARRecipe(None, HARModelConfig(), None, None, loss_cfg=HARLossConfig(label_smoothing=0.1))
    batch = (torch.randn(7, C, T), torch.full((7,), T), torch.zeros(7, dtype=torch.long))
    assert of(recipe, Batching).batch_size_of(batch) == 7                   # windows, not 7 x 9 channel series
    model = net()
    smooth = recipe.training_step(model, batch)
    plain = HARRecipe(None, HARModelConfig(), None, None, loss_cfg=HARLossConfig()).training_step(model, batch)
    assert smooth.item() != pytest.approx(plain.item())

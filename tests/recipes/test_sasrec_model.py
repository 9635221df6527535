"""SASRec/TiSASRec/mHC model properties and the ranking metrics."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from trainer.recipes.sasrec import model as M
from trainer.recipes.sasrec.model import MHCMaps, SelfAttention, SeqRec, SeqRecConfig, sinkhorn
from trainer.recipes.sasrec.recipe import rank_stats

VARIANTS = [dict(time=t, mhc=m) for t in (True, False) for m in (True, False)]


def batch(b=3, t=12, items=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, items + 1, (b, t), generator=g)
    seq[0, :4] = 0                                        # left padding
    time = torch.cumsum(torch.randint(0, 5, (b, t), generator=g), 1) + 1
    time[seq == 0] = 0
    return seq, time


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"time={v['time']},mhc={v['mhc']}")
def test_causal_future_items_do_not_change_past_logits(variant):
    torch.manual_seed(0)
    model = SeqRec(SeqRecConfig(width=16, heads=2, **variant), num_items=30, maxlen=12).eval()
    seq, time = batch()
    h1 = model.features(seq, time)
    seq2, time2 = seq.clone(), time.clone()
    seq2[:, 8] = (seq2[:, 8] % 30) + 1                    # change the item at t=8 (and its time)
    time2[:, 8:] += 3
    h2 = model.features(seq2, time2)
    assert torch.allclose(h1[:, :8], h2[:, :8], atol=1e-6)
    assert not torch.allclose(h1[:, 8:], h2[:, 8:], atol=1e-4)
    assert torch.isfinite(h1).all()


def slow_time_attention(att: SelfAttention, x, seq, time, span):
    """TiSASRec's reference formulation with explicit (T, T, D) relation tensors, one user at a time."""
    outs = []
    t = x.shape[1]
    for b in range(x.shape[0]):
        rel = np.minimum(np.abs(time[b, :, None].numpy() - time[b, None, :].numpy()), span)
        ek, ev = att.time_k.weight[torch.from_numpy(rel)], att.time_v.weight[torch.from_numpy(rel)]  # (T,T,D)
        pk, pv = att.pos_k.weight[:t], att.pos_v.weight[:t]
        q, k, v = att.q(x[b]), att.k(x[b]), att.v(x[b])
        scores = (q @ (k + pk).T + (q[:, None, :] * ek).sum(-1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool).tril() & (seq[b] != 0)[None, :] | torch.eye(t, dtype=torch.bool)
        a = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        out = a @ (v + pv) + (a[:, :, None] * ev).sum(1)
        outs.append(att.out(out))
    return torch.stack(outs)


def test_time_interval_attention_matches_slow_reference():
    torch.manual_seed(1)
    cfg = SeqRecConfig(width=8, heads=1, time=True, mhc=False, time_span=6, dropout=0.0)
    model = SeqRec(cfg, num_items=30, maxlen=12).eval()
    seq, time = batch()
    x = torch.randn(3, 12, 8)
    keep, mask = model._masks(seq, time)
    att = model.blocks[0].attn.fn
    fast = att(x, mask=mask)
    assert mask.rel.max() == 6 and mask.rel.min() == 0
    assert torch.allclose(fast, slow_time_attention(att, x, seq, time, 6), atol=1e-5)


@pytest.mark.parametrize("time_aware", [False, True])
def test_causal_query_blocks_compute_the_same_attention(time_aware, monkeypatch):
    """Training-mode attention computed as two query blocks (the first half against the first half of the keys)
    equals one block over all keys: outputs and gradients, with padded rows, SASRec and TiSASRec."""
    assert M.causal_blocks(100) == [(0, 50), (50, 100)] and M.causal_blocks(63) == [(0, 63)]
    torch.manual_seed(3)
    t = 70
    cfg = SeqRecConfig(width=8, heads=2, time=time_aware, mhc=False, time_span=9, dropout=0.0)
    model = SeqRec(cfg, num_items=40, maxlen=t).train()
    lengths = torch.tensor([70, 41, 5])
    seq = torch.where(torch.arange(t) >= t - lengths[:, None], torch.randint(1, 41, (3, t)), 0)
    time = torch.cumsum(torch.randint(0, 4, (3, t)), 1) * (seq != 0)
    keep, mask = model._masks(seq, time)
    att = model.blocks[0].attn.fn
    att.attn_drop.p, att.fused = 1e-9, False    # the explicit PyTorch (training) path, with nothing dropped
    x = torch.randn(3, t, 8, requires_grad=True)

    def run(blocks):
        monkeypatch.setattr(M, "causal_blocks", blocks)
        out = att(x, mask=mask) * keep
        return (out, *torch.autograd.grad(out.square().sum(), [x, *att.parameters()], allow_unused=True))

    split, whole = run(M.causal_blocks), run(lambda n: [(0, n)])
    for a, b in zip(split, whole):
        if a is not None:
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_mhc_residual_matrix_is_doubly_stochastic(amp):
    torch.manual_seed(2)
    cfg = SeqRecConfig(mhc_gate_init=1.0)                 # large gates: far from the identity start
    maps = MHCMaps(4, 16, cfg)
    with torch.no_grad():
        maps.b_res.zero_()                                 # no identity prior: a non-trivial matrix
        maps.proj.weight.normal_(std=0.2)                  # logits with std ~1.6
    x = torch.randn(2, 5, 4, 16)
    ctx = torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False)
    with ctx:
        pre, post, res = maps(x)
    assert res.dtype == torch.float32                      # mhc_fp32 keeps the maps in fp32 under AMP
    assert torch.allclose(res.sum(-1), torch.ones(2, 5, 4), atol=1e-3)
    assert torch.allclose(res.sum(-2), torch.ones(2, 5, 4), atol=1e-3)
    assert (pre > 0).all() and (pre < 1).all() and (post > 0).all() and (post < 2).all()
    assert not torch.allclose(res, torch.eye(4).expand_as(res), atol=0.05)


def test_mhc_starts_near_identity_and_keeps_streams():
    maps = MHCMaps(4, 16, SeqRecConfig())
    pre, post, res = maps(torch.randn(2, 5, 4, 16))
    assert torch.allclose(res, torch.eye(4).expand_as(res), atol=0.06)
    assert (res.diagonal(dim1=-2, dim2=-1) > 0.9).all()
    assert torch.allclose(pre, torch.full_like(pre, 0.25), atol=1e-2)
    assert torch.allclose(post, torch.ones_like(post), atol=2e-2)
    assert torch.allclose(sinkhorn(torch.zeros(3, 3), 20), torch.full((3, 3), 1 / 3))


def test_mhc_streams_diverge_inside_the_network():
    """The streams are kept (B, T, n, D) between blocks: after training-like updates they differ."""
    torch.manual_seed(3)
    model = SeqRec(SeqRecConfig(width=16, mhc_gate_init=0.5, dropout=0.0), num_items=30, maxlen=12)
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model.features(*batch())
    streams = seen[0]
    assert streams.shape[2] == 4 and not torch.allclose(streams[:, :, 0], streams[:, :, 1])


def test_loss_variants_and_gradient_checkpointing_agree():
    torch.manual_seed(4)
    cfg = SeqRecConfig(width=16, dropout=0.0)
    a = SeqRec(cfg, 30, 12)
    b = SeqRec(SeqRecConfig(width=16, dropout=0.0, grad_checkpoint=True), 30, 12)
    b.load_state_dict(a.state_dict())
    seq, time = batch()
    pos, neg = seq.roll(-1, 1), torch.randint(1, 31, (3, 12, 2))
    (la := a(seq, time, pos, neg)[0].sum()).backward()
    (lb := b(seq, time, pos, neg)[0].sum()).backward()
    assert torch.allclose(la, lb)
    assert torch.allclose(a.item_emb.weight.grad, b.item_emb.weight.grad, atol=1e-5)


def test_rank_metrics_match_brute_force():
    rng = np.random.default_rng(0)
    scores = torch.from_numpy(rng.normal(size=(50, 101)))
    rank = (scores[:, 1:] > scores[:, :1]).sum(1)
    stats = rank_stats(rank, (1, 10), "")
    hr, ndcg = 0.0, 0.0
    for row in scores.numpy():
        r = list(np.argsort(-row)).index(0)               # position of the target when sorted
        hr += r < 10
        ndcg += 1 / math.log2(r + 2) if r < 10 else 0
    assert stats["hr@10"].item() == hr and abs(stats["ndcg@10"].item() - ndcg) < 1e-9
    assert stats["hr@1"].item() == (rank == 0).sum().item()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"time={v['time']},mhc={v['mhc']}")
def test_length_buckets_compute_the_same_function(variant):
    """Trimming each length bucket's common padding changes nothing: padded keys are masked and
    positions keep their full-length index."""
    torch.manual_seed(5)
    cfg = SeqRecConfig(width=16, heads=2, dropout=0.0, **variant)
    full = SeqRec(SeqRecConfig(**{**cfg.__dict__, "length_buckets": 1}), 30, 40).eval()
    bucketed = SeqRec(SeqRecConfig(**{**cfg.__dict__, "length_buckets": 3}), 30, 40).eval()
    bucketed.load_state_dict(full.state_dict())
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, 31, (10, 40), generator=g)
    lengths = torch.tensor([40, 3, 17, 1, 25, 8, 39, 12, 5, 30])
    for row, n in enumerate(lengths):
        seq[row, : 40 - n] = 0
    time = torch.cumsum(torch.randint(0, 4, (10, 40), generator=g), 1) * (seq != 0)
    a, b = full.features(seq, time), bucketed.features(seq, time)
    assert torch.allclose(a, b, atol=1e-5)
    cand = torch.randint(1, 31, (10, 7), generator=g)
    assert torch.allclose(full.score(seq, time, cand), bucketed.score(seq, time, cand), atol=1e-4)
    assert torch.allclose(full.score(seq, time), bucketed.score(seq, time), atol=1e-4)
    pos, neg = seq.roll(-1, 1), torch.randint(1, 31, (10, 40, 3), generator=g)   # training logits, per bucket
    outs = [model.train()(seq, time, pos, neg) for model in (full, bucketed)]
    for x, y in zip(*outs):
        assert x.shape == y.shape and torch.allclose(x, y, atol=1e-4)
    # and the same gradients (mHC trains on the whole batch's packed positions, its attention per bucket)
    grads = [torch.autograd.grad(sum(o.square().sum() for o in out), list(model.parameters()), allow_unused=True)
             for out, model in zip(outs, (full, bucketed))]
    for x, y in zip(*grads):
        assert (x is None) == (y is None) and (x is None or torch.allclose(x, y, atol=1e-4, rtol=1e-4))


def test_packing_runs_a_function_per_length_bucket_and_restores_the_packed_order():
    seq = torch.zeros(6, 10, dtype=torch.long)
    for row, n in enumerate([10, 2, 7, 1, 5, 9]):
        seq[row, 10 - n:] = torch.arange(1, n + 1)
    packing = M.Packing(seq, buckets=3)
    x = packing.pack(torch.arange(60.0).view(6, 10, 1) + 1)            # each position's flat index + 1
    seen = []

    def fn(xb, rows, cut):
        seen.append((rows.tolist(), cut, xb.shape[:2]))
        expected = (torch.arange(60.0).view(6, 10) + 1)[rows, cut:] * (seq[rows, cut:] != 0)
        assert torch.equal(xb[..., 0], expected)                         # the bucket's padded form
        return xb * 2
    assert torch.equal(packing.per_bucket(x, fn), x * 2)
    assert sorted(r for rows, _, _ in seen for r in rows) == list(range(6))
    assert [(cut, tuple(shape)) for _, cut, shape in seen] == [(0, (2, 10)), (3, (2, 7)), (8, (2, 2))]
    assert M.Packing(seq[:4], buckets=3).groups is None                    # too few rows: the whole batch


def test_fast_dropout_has_the_right_rate_and_expectation():
    from trainer.recipes.dropout import Dropout
    torch.manual_seed(0)
    drop = Dropout(0.2).train()
    y = drop(torch.ones(1_000_000))
    assert abs((y == 0).float().mean().item() - 0.2) < 0.003
    assert abs(y.mean().item() - 1.0) < 0.005
    a, b = drop(torch.ones(1000)), drop(torch.ones(1000))
    assert not torch.equal(a, b)                                     # fresh mask per call
    x = torch.randn(100)
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(Dropout(1e-9).train()(torch.ones(1_000_000)), torch.ones(1_000_000))   # nothing dropped


def unrolled_sinkhorn(logits, iters):
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def test_sinkhorn_gradient_is_that_of_the_converged_projection():
    """The implicit backward equals autograd through 2000 unrolled iterations, and passes gradcheck."""
    torch.manual_seed(6)
    logits = (torch.randn(16, 4, 4, dtype=torch.float64) * 1.5).requires_grad_()
    weights = torch.randn(16, 4, 4, dtype=torch.float64)
    (reference,) = torch.autograd.grad((unrolled_sinkhorn(logits, 2000) * weights).sum(), logits)
    out = sinkhorn(logits, 500, 1e-12)
    (ours,) = torch.autograd.grad((out * weights).sum(), logits)
    assert torch.allclose(out, unrolled_sinkhorn(logits, 2000).detach(), atol=1e-9)
    assert torch.allclose(ours, reference, atol=1e-7)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, 500, 1e-12), (logits[:3].detach().requires_grad_(),))


def test_sinkhorn_tolerance_stops_early_and_counts():
    from trainer.recipes.sasrec.model import _Sinkhorn
    torch.manual_seed(7)
    logits = 0.3 * torch.randn(300, 4, 4)                   # mild maps converge in a few iterations
    used = {}
    for tol in (1e-3, 1e-5):
        res = sinkhorn(logits, 20, tol)
        used[tol] = _Sinkhorn.last_iterations
        assert (res.sum(-1) - 1).abs().max() <= tol
        assert torch.allclose(res.sum(-2), torch.ones(300, 4), atol=1e-6)
    assert 1 <= used[1e-3] < used[1e-5] < 20
    assert torch.allclose(sinkhorn(logits, 20, 0.0), unrolled_sinkhorn(logits, 20), atol=1e-6)
    assert _Sinkhorn.last_iterations == 20                 # tol=0: the fixed count of the seed scripts


def _mixed_maps(count: int = 200, seed: int = 12, sharpest: float = 8.0) -> torch.Tensor:
    """Logits from mild to sharp: with the defaults the mildest maps reach rows within 1e-4 in 2 iterations
    and a tenth need over 300 (in float64; sharp maps late in training need up to ~100)."""
    torch.manual_seed(seed)
    return torch.randn(count, 4, 4) * torch.linspace(0.3, sharpest, count).view(-1, 1, 1)


def test_sinkhorn_stops_each_map_on_its_own():
    """A map's result does not depend on the maps beside it: each stops once its own rows are within tol (one
    stop for all held the mild maps for the slowest, and the cap left the slow ones off); the count returned
    is the slowest map's."""
    from trainer.recipes.sasrec.model import _Sinkhorn
    logits, tol = _mixed_maps(), 1e-4
    together = sinkhorn(logits, 60, tol)
    assert _Sinkhorn.last_iterations == 60                 # some maps need more than 60
    alone = [sinkhorn(logits[k:k + 1], 60, tol) for k in range(len(logits))]
    counts = []
    for k, one in enumerate(alone):
        sinkhorn(logits[k:k + 1], 60, tol)
        counts.append(_Sinkhorn.last_iterations)
        assert torch.equal(together[k:k + 1], one), k
    assert min(counts) <= 3 and max(counts) == 60
    rows_off = (together.sum(-1) - 1).abs().amax(-1)
    finished = torch.tensor(counts) < 60
    assert bool((rows_off[finished] <= tol).all()) and int(finished.sum()) >= 100
    # a mild map stopped where it first met tol: one more iteration would have changed it
    mild = int(torch.tensor(counts).argmin())
    assert not torch.equal(sinkhorn(logits[mild:mild + 1], counts[mild] + 1, 0.0), together[mild:mild + 1])
    assert torch.allclose(sinkhorn(logits[mild:mild + 1], counts[mild], 0.0), together[mild:mild + 1], atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_maps_record_the_largest_row_error(fused):
    """MHCMaps keeps the largest |row sum - 1| of its H_res since reset_counts (the recipe logs it): above the
    tolerance when the cap stops the Sinkhorn early, within it when the maps converge."""
    torch.manual_seed(3)
    seq = torch.randint(1, 40, (6, 12))
    errors = {}
    for iters in (1, 200):
        model = SeqRec(SeqRecConfig(time=False, width=16, depth=1, heads=1, dropout=0.0, mhc_gate_init=2.0,
                                    mhc_sinkhorn_iters=iters, mhc_newton_steps=0, mhc_fused=fused),
                       num_items=40, maxlen=12)
        seen = []
        maps = model.blocks[0].ffn.maps
        maps.register_forward_hook(lambda m, a, out: seen.append(out[2]))
        model(seq, seq, seq, seq.unsqueeze(-1))
        assert maps.sinkhorn_row_error == (seen[0].sum(-1) - 1).abs().max()
        errors[iters] = float(maps.sinkhorn_row_error)
        maps.reset_counts()
        assert maps.sinkhorn_row_error is None and maps.sinkhorn_calls == 0
    assert errors[1] > 1e-3 and errors[200] <= 1e-4


def test_newton_steps_reach_the_converged_projection():
    """Sharp maps that 20 iterations leave far off: Newton steps bring every map's rows within tol, the maps
    and their gradient to those of the converged projection (float64, 20,000 iterations), and never leave a
    map worse than the iterations did; tol=0 (the fixed count) takes none."""
    logits = _mixed_maps(1000, seed=13).requires_grad_()
    weights = torch.randn(1000, 4, 4)
    converged = unrolled_sinkhorn(logits.detach().double(), 20000)
    (grad_ref,) = torch.autograd.grad((sinkhorn(logits.double(), 20000, 1e-12) * weights).sum(), logits)
    plain = sinkhorn(logits, 20, 1e-4)
    polished = sinkhorn(logits, 20, 1e-4, newton=8)
    err_plain, err = ((m.detach().sum(-1) - 1).abs().amax(-1) for m in (plain, polished))
    assert int((err_plain > 1e-3).sum()) > 200 and float(err.max()) <= 1e-4
    assert bool((err <= err_plain + 1e-7).all())
    assert torch.allclose(polished.detach().sum(-2), torch.ones(1000, 4), atol=1e-6)
    off = [float((m.detach().double() - converged).abs().max()) for m in (polished, plain)]
    assert off[0] < 2e-4 < off[1]
    (grad,) = torch.autograd.grad((polished * weights).sum(), logits)
    (grad_plain,) = torch.autograd.grad((plain * weights).sum(), logits)
    assert (grad - grad_ref).abs().max() < 0.1 * (grad_plain - grad_ref).abs().max()
    assert torch.equal(sinkhorn(logits, 20, 0.0, newton=8), sinkhorn(logits, 20, 0.0))


def test_mhc_fused_ops_have_exact_gradients():
    from trainer.recipes.sasrec.model import NormProj, StreamMix
    torch.manual_seed(8)
    x, w = torch.randn(6, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    reference = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (12,), eps=1e-6), w)
    assert torch.allclose(NormProj.apply(x, w, 1e-6), reference)
    assert torch.autograd.gradcheck(lambda a, b: NormProj.apply(a, b, 1e-6),
                                    (x.requires_grad_(), w.requires_grad_()))
    args = [torch.rand(6, 4, 4), torch.randn(6, 4, 3), torch.rand(6, 4), torch.randn(6, 3)]
    args = [a.double().requires_grad_() for a in args]
    res, streams, post, y = args
    assert torch.allclose(StreamMix.apply(*args), torch.einsum("nkj,njd->nkd", res, streams)
                          + post.unsqueeze(-1) * y.unsqueeze(1))
    assert torch.autograd.gradcheck(StreamMix.apply, args)


def test_mhc_maps_without_fp32_stay_doubly_stochastic_in_bf16():
    torch.manual_seed(2)                                   # the maps of the fp32 test above
    maps = MHCMaps(4, 16, SeqRecConfig(mhc_gate_init=1.0, mhc_fp32=False))
    with torch.no_grad():
        maps.b_res.zero_()
        maps.proj.weight.normal_(std=0.2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, res = maps(torch.randn(2, 5, 4, 16))
    assert torch.allclose(res.float().sum(-1), torch.ones(2, 5, 4), atol=1e-3)
    assert torch.allclose(res.float().sum(-2), torch.ones(2, 5, 4), atol=1e-3)


@pytest.mark.parametrize("mhc", [False, True])
def test_normal_init_draws_matrices_at_init_std_and_zeroes_biases(mhc):
    """model.init=normal (Klenitskiy & Vasilev's and RecBole's N(0, 0.02)); xavier stays the default, so every
    checkpoint and figure trained before keeps its initialisation."""
    assert SeqRecConfig().init == "xavier"
    torch.manual_seed(0)
    xavier = SeqRec(SeqRecConfig(width=32, time=False, mhc=mhc), num_items=5000, maxlen=20)
    torch.manual_seed(0)
    normal = SeqRec(SeqRecConfig(width=32, time=False, mhc=mhc, init="normal", init_std=0.05), num_items=5000,
                    maxlen=20)
    # xavier's embedding std is sqrt(2 / (items + width)): ~1/50 of N(0, 0.05) at 5,000 items
    assert normal.item_emb.weight[1:].std().item() == pytest.approx(0.05, rel=0.02)
    assert xavier.item_emb.weight[1:].std().item() == pytest.approx(math.sqrt(2 / 5033), rel=0.02)
    assert not normal.item_emb.weight[0].any() and not normal.pos_emb.weight[0].any()      # padding rows
    for name, p in normal.named_parameters():
        if name.endswith(".bias"):
            assert not p.any(), name
        elif ".maps." in name:              # the mHC maps keep their near-identity start
            assert torch.equal(p, dict(xavier.named_parameters())[name]), name
        elif p.dim() >= 2 and name != "item_emb.weight" and name != "pos_emb.weight":
            assert p.std().item() == pytest.approx(0.05, rel=0.25), name


def test_original_norm_is_the_block_of_both_papers_code():
    """model.norm=original against the block written out as SASRec's 2018 code has it: queries LN(x), keys and
    values the raw x, the residual LN(x); then LN(x) + FFN(LN(x)); padded positions zeroed after each block."""
    torch.manual_seed(0)
    cfg = SeqRecConfig(width=16, heads=2, time=False, mhc=False, norm="original", dropout=0.0, length_buckets=3)
    model = SeqRec(cfg, num_items=30, maxlen=12).eval()
    seq, time = batch(b=4)
    seq[1, :9] = 0
    keep = (seq != 0).unsqueeze(-1).float()
    positions = torch.arange(1, 13) * (seq != 0)
    x = (model.item_emb(seq) * 4.0 + model.pos_emb(positions)) * keep
    allowed = torch.ones(12, 12).tril().bool() & (seq != 0)[:, None, :] | torch.eye(12).bool()
    for block in model.blocks:
        att, h = block.attn.fn, block.attn.norm(x)
        split = lambda t: t.view(4, 12, 2, 8).transpose(1, 2)                     # noqa: E731
        scores = split(att.q(h)) @ split(att.k(x)).mT / math.sqrt(8)
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
        x = h + att.out((probs @ split(att.v(x))).transpose(1, 2).reshape(4, 12, 16))
        h = block.ffn.norm(x)
        x = (h + block.ffn.fn.net(h)) * keep
    expected = model.last_norm(x) * keep
    assert torch.allclose(model.features(seq, time), expected, atol=1e-5)
    pre = SeqRec(dataclasses.replace(cfg, norm="pre"), num_items=30, maxlen=12).eval()
    pre.load_state_dict(model.state_dict())                        # the same parameters, another function
    assert not torch.allclose(pre.features(seq, time), expected, atol=1e-3)


def test_positions_from_start_do_not_depend_on_the_padding_before_a_sequence():
    """model.positions=from_start numbers a sequence's items from its oldest (right-padded code's positions), so
    its representation is the same however much padding precedes it; from_end numbers them back from the newest
    (maxlen), where the same items at another length get other positions."""
    seq, time = batch(b=3, t=12)
    seq[:, :5] = 0
    for positions, same in (("from_start", True), ("from_end", False)):
        torch.manual_seed(0)
        cfg = SeqRecConfig(width=16, heads=2, time=False, mhc=False, positions=positions, length_buckets=2)
        model = SeqRec(cfg, num_items=30, maxlen=12).eval()
        full, trimmed = model.features(seq, time)[:, -4:], model.features(seq[:, 3:], time[:, 3:])[:, -4:]
        assert torch.allclose(full, trimmed, atol=1e-5) == same, positions

"""KGAT model pieces against slow references and hand computations."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.recipes import kernels
from trainer.recipes.kgat import convert
from trainer.recipes.kgat import data as kd
from trainer.recipes.kgat import model as M
from trainer.recipes.kgat.config import KGATLossConfig
from trainer.recipes.kgat.model import KGAT, KGATModelConfig, attention_scores, l2_mean, sparse_softmax


def small_graph():
    d = convert.synthesize(convert.Stats(users=20, items=15, entities=30, relations=3, triples=60, interactions=80))
    return d, kd.build_ckg(d)


def model_for(d, g, cf_l2: float = 1e-5, kg_l2: float = 1e-5, **cfg) -> KGAT:
    torch.manual_seed(0)
    m = KGAT(KGATModelConfig(width=8, relation_width=6, layer_widths=[8, 4], **cfg), d.n_entities, d.n_users,
             g.n_relations, len(g.heads), loss=KGATLossConfig(cf_l2=cf_l2, kg_l2=kg_l2))
    m.set_graph(g.heads, g.rels, g.tails, g.weights)
    return m


def test_sparse_softmax_equals_a_softmax_per_head():
    d, g = small_graph()
    scores = torch.randn(len(g.heads), dtype=torch.float64) * 3
    got = sparse_softmax(scores, g.heads, g.n_nodes)
    for h in torch.unique(g.heads).tolist():
        mask = g.heads == h                      # one head's edges (several relations may join h and t)
        assert torch.allclose(got[mask], torch.softmax(scores[mask], 0), atol=1e-12)
    # and as a dense row-softmax where (h, t) pairs are unique
    keep = torch.ones(len(g.heads), dtype=torch.bool)
    seen = set()
    for k, pair in enumerate(zip(g.heads.tolist(), g.tails.tolist())):
        keep[k] = pair not in seen
        seen.add(pair)
    h, t, sc = g.heads[keep], g.tails[keep], scores[keep]
    dense = torch.full((g.n_nodes, g.n_nodes), float("-inf"), dtype=torch.float64)
    dense[h, t] = sc
    assert torch.allclose(sparse_softmax(sc, h, g.n_nodes), torch.softmax(dense, 1)[h, t], atol=1e-12)


def _per_edge(m, k):
    h, r, t = int(m.heads[k]), int(m.rels[k]), int(m.tails[k])
    w = m.trans[r].detach()
    return (m.embed[t].detach() @ w) @ torch.tanh(m.embed[h].detach() @ w + m.relation[r].detach())


@pytest.mark.parametrize("kernel", [True, False], ids=["gather_dot", "pytorch"])
def test_attention_scores_equal_a_per_edge_reference(kernel, monkeypatch):
    """Scores come in by_rel order (relation by relation), each (node, relation) projected once; the C++
    product and the PyTorch path's agree with the formula edge by edge."""
    d, g = small_graph()
    m = model_for(d, g)
    if not kernel:
        monkeypatch.setattr(M, "cpu_kernels", lambda: None)
    elif M.cpu_kernels() is None:
        pytest.skip(f"the C++ kernels cannot be built here: {kernels.unavailable_reason()}")
    got = attention_scores(m)
    assert len(got) == len(g.heads)
    for k in range(len(g.heads)):
        assert torch.allclose(got[k], _per_edge(m, int(m.by_rel[k])), atol=1e-6), k


def test_attention_scores_under_autocast_are_the_fp32_scores():
    d, g = small_graph()
    m = model_for(d, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention_scores(m)
    assert got.dtype == torch.float32 and torch.equal(got, attention_scores(m))


def test_attention_scores_of_any_slice_equal_the_whole():
    """refresh_attention's ranks each score a slice of by_rel order, cutting relation runs anywhere."""
    d, g = small_graph()
    m = model_for(d, g)
    whole, n = attention_scores(m), len(g.heads)
    assert len(m.runs) == len(set(g.rels.tolist())) > 1
    for lo, hi in [(0, n), (1, n - 1), (3, 4), (n // 3, 2 * n // 3), (m.runs[1][1], m.runs[1][2]), (5, 5)]:
        assert torch.equal(attention_scores(m, lo, hi), whole[lo:hi]), (lo, hi)


def test_relation_runs_list_each_runs_distinct_nodes_once():
    d, g = small_graph()
    m = model_for(d, g)
    heads, rels, tails = (x[m.by_rel] for x in (g.heads, g.rels, g.tails))
    for r, e0, e1, h0, h1, t0, t1 in m.runs:
        assert bool((rels[e0:e1] == r).all())
        assert m.run_heads[h0:h1].tolist() == sorted(set(heads[e0:e1].tolist()))
        assert m.run_tails[t0:t1].tolist() == sorted(set(tails[e0:e1].tolist()))
        assert torch.equal(m.run_heads[h0:h1][m.head_slot[e0:e1].long()].long(), heads[e0:e1])
        assert torch.equal(m.run_tails[t0:t1][m.tail_slot[e0:e1].long()].long(), tails[e0:e1])
    assert m.head_slot.dtype == m.tail_slot.dtype == torch.int32


def test_balanced_bounds_give_ranks_equal_scoring_cost():
    # (relation, edges e0..e1, heads h0..h1, tails t0..t1): a cheap run (few distinct nodes) then costly ones
    runs = [(0, 0, 900, 0, 100, 0, 100), (1, 900, 1000, 100, 200, 100, 200), (2, 1000, 1100, 200, 300, 200, 300)]
    assert M.balanced_bounds(runs, 1, 1100) == [0, 1100]
    nodes = 100 * (M.HEAD_COST + M.TAIL_COST)                           # each run: 100 heads, 100 tails
    costs = [900 + nodes, 100 + nodes, 100 + nodes]
    two = M.balanced_bounds(runs, 2, 1100)
    assert two[0] == 0 and two[-1] == 1100 and 900 < two[1] < 1000     # half the cost, not half the edges
    assert two[1] == 900 + round((sum(costs) / 2 - costs[0]) / costs[1] * 100)   # in run 1, by its cost
    three = M.balanced_bounds(runs, 3, 1100)
    assert three == sorted(three) and len(three) == 4 and three[1] < 900
    assert M.balanced_bounds([], 4, 0) == [0, 0, 0, 0, 0]
    # a head costs more than a tail (bias and tanh): of two runs alike but for which end has 100 distinct nodes,
    # the head-heavy one holds the split
    assert M.HEAD_COST > M.TAIL_COST
    assert M.balanced_bounds([(0, 0, 100, 0, 100, 0, 10), (1, 100, 200, 100, 110, 10, 110)], 2, 200)[1] < 100


def test_segment_softmax_kernel_equals_the_scatter_softmax():
    ops = M.cpu_kernels()
    if ops is None:
        pytest.skip(f"the C++ kernels cannot be built here: {kernels.unavailable_reason()}")
    heads = torch.tensor([0, 0, 0, 2, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])   # nodes 1, 3 have none
    crow = torch.zeros(7, dtype=torch.int64)
    crow[1:] = torch.bincount(heads, minlength=6).cumsum(0)
    scores = torch.randn(len(heads)) * 30                                   # large: the max must be taken out
    got = ops.segment_softmax(scores, crow)
    assert torch.allclose(got, sparse_softmax(scores, heads, 6), atol=1e-6)
    assert got[3] == 1.0 and torch.allclose(torch.zeros(6).index_add_(0, heads, got)[[0, 2, 4, 5]], torch.ones(4))
    with pytest.raises(RuntimeError, match="edge count"):
        ops.segment_softmax(scores[:-1], crow)


def test_gather_dot_refuses_an_index_out_of_range():
    ops = M.cpu_kernels()
    if ops is None:
        pytest.skip(f"the C++ kernels cannot be built here: {kernels.unavailable_reason()}")
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    idx = torch.tensor([0, 3], dtype=torch.int32)
    assert torch.allclose(ops.gather_dot(a, idx, b, torch.tensor([1, 0], dtype=torch.int32)),
                          torch.stack([a[0] @ b[1], a[3] @ b[0]]))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gather_dot(a, idx, b, torch.tensor([0, 2], dtype=torch.int32))


def test_refreshed_propagation_matrix_rows_sum_to_one_and_match_dense():
    d, g = small_graph()
    m = model_for(d, g)
    m.refresh_attention()
    # scored relation by relation (m.by_rel), then put back in edge order: the same as scoring edge by edge
    per_edge = torch.stack([_per_edge(m, k) for k in range(len(g.heads))])
    in_edge_order = sparse_softmax(per_edge, g.heads, g.n_nodes)
    assert bool((g.rels[m.by_rel][1:] >= g.rels[m.by_rel][:-1]).all()) and len(set(g.rels.tolist())) > 1
    assert torch.allclose(m.attention, in_edge_order, atol=1e-6)
    dense = m.adj.to_dense()
    rows = dense.sum(1)
    has = torch.bincount(g.heads, minlength=g.n_nodes) > 0
    assert torch.allclose(rows[has], torch.ones(int(has.sum())), atol=1e-5)
    x = torch.randn(g.n_nodes, 5)
    assert torch.allclose(torch.sparse.mm(m.adj, x), dense @ x, atol=1e-5)


@pytest.mark.parametrize("aggregator", ["bi-interaction", "gcn", "graphsage"])
def test_propagation_shapes_normalisation_and_gradients(aggregator):
    d, g = small_graph()
    m = model_for(d, g, aggregator=aggregator)
    m.eval()
    emb = m.propagate()
    assert emb.shape == (g.n_nodes, m.out_dim) and m.out_dim == 8 + 8 + 4
    assert torch.allclose(emb[:, 8:16].norm(dim=1), torch.ones(g.n_nodes), atol=1e-5)
    m.train()
    loss = m.cf_loss(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5]))
    loss.backward()
    assert m.embed.grad is not None and m.aggregators[0].w1.weight.grad.abs().sum() > 0


def test_bpr_loss_equals_hand_computation():
    d, g = small_graph()
    m = model_for(d, g, dropout=0.0, cf_l2=0.1)
    users, pos, neg = torch.tensor([0, 3]), torch.tensor([1, 2]), torch.tensor([5, 6])
    emb = m.propagate().detach()
    u, p, n = emb[users + d.n_entities], emb[pos], emb[neg]
    expected = 0.0
    for k in range(2):
        x = float(u[k] @ p[k] - u[k] @ n[k])
        expected += np.log1p(np.exp(-x)) / 2                          # -log sigmoid(x)
    expected += 0.1 * sum(float((t ** 2).sum(1).div(2).mean()) for t in (u, p, n))
    assert abs(m.cf_loss(users, pos, neg).item() - expected) < 1e-5


def test_cf_gradients_equal_those_of_gathering_from_the_concatenation():
    """cf_loss gathers the batch's rows layer by layer (one zero-filled gradient per layer); every parameter's
    gradient equals gathering users, positives and negatives from propagate()'s concatenation, repeated rows
    (an item positive for one user and negative for another) included."""
    d, g = small_graph()
    users, pos, neg = torch.tensor([0, 3, 3]), torch.tensor([1, 2, 5]), torch.tensor([5, 1, 6])
    grads = []
    for by_layer in (True, False):
        m = model_for(d, g, dropout=0.0, cf_l2=0.1)
        if by_layer:
            loss = m.cf_loss(users, pos, neg)
        else:
            emb = m.propagate()
            u, p, n = emb[users + d.n_entities], emb[pos], emb[neg]
            loss = F.softplus((u * n).sum(1) - (u * p).sum(1)).mean() + 0.1 * (l2_mean(u) + l2_mean(p) + l2_mean(n))
        loss.backward()
        grads.append({k: q.grad.clone() for k, q in m.named_parameters() if q.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "embed" in grads[0]
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-7), k


def test_transr_loss_equals_hand_computation():
    d, g = small_graph()
    m = model_for(d, g, kg_l2=0.01)
    h, r, pt, nt = torch.tensor([0, 7]), torch.tensor([2, 4]), torch.tensor([16, 20]), torch.tensor([3, 25])
    expected, l2 = 0.0, []
    for k in range(2):
        w, e_r = m.trans[r[k]].detach(), m.relation[r[k]].detach()
        hr, pr, nr = m.embed[h[k]].detach() @ w, m.embed[pt[k]].detach() @ w, m.embed[nt[k]].detach() @ w
        pos, neg = float(((hr + e_r - pr) ** 2).sum()), float(((hr + e_r - nr) ** 2).sum())
        expected += np.log1p(np.exp(pos - neg)) / 2
        l2.append([hr, e_r, pr, nr])
    expected += 0.01 * sum(float(torch.stack([row[j] for row in l2]).pow(2).sum(1).div(2).mean()) for j in range(4))
    assert abs(m.kg_loss(h, r, pt, nt).item() - expected) < 1e-5


def test_l2_mean_and_pretrained_embeddings(tmp_path):
    assert float(l2_mean(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))) == pytest.approx(6.25)
    d, g = small_graph()
    m = model_for(d, g)
    users, items = np.random.rand(d.n_users, 8).astype(np.float32), np.random.rand(d.n_items, 8).astype(np.float32)
    np.savez(tmp_path / "mf.npz", user_embed=users, item_embed=items)
    m.load_pretrained(str(tmp_path / "mf.npz"), d.n_items)
    assert torch.equal(m.embed[d.n_entities:].detach(), torch.from_numpy(users))
    assert torch.equal(m.embed[:d.n_items].detach(), torch.from_numpy(items))
    np.savez(tmp_path / "bad.npz", user_embed=users[:3], item_embed=items)
    with pytest.raises(ValueError, match="do not match"):
        m.load_pretrained(str(tmp_path / "bad.npz"), d.n_items)


def test_scores_are_user_item_dot_products():
    d, g = small_graph()
    m = model_for(d, g)
    m.eval()
    emb = m.propagate()
    s = m.score_users(torch.tensor([2, 5]), emb, d.n_items)
    assert s.shape == (2, d.n_items)
    assert torch.allclose(s[1, 4], emb[5 + d.n_entities] @ emb[4])


def test_attention_is_saved_and_the_graph_is_not():
    d, g = small_graph()
    m = model_for(d, g)
    m.refresh_attention()
    state = m.state_dict()
    assert "attention" in state and not {"heads", "rels", "tails", "crow"} & set(state)
    fresh = model_for(d, g)                      # same graph, Laplacian weights
    assert not torch.equal(fresh.adj.to_dense(), m.adj.to_dense())
    fresh.load_state_dict(state)
    assert torch.equal(fresh.adj.to_dense(), m.adj.to_dense())
    with pytest.raises(ValueError, match="sorted by head"):
        fresh.set_graph(g.heads.flip(0), g.rels, g.tails, g.weights)


def test_propagation_gradient_uses_the_transpose_and_matches_a_dense_reference():
    d, g = small_graph()
    m = model_for(d, g, dropout=0.0)
    m.refresh_attention()
    assert torch.allclose(m.adj_t.to_dense(), m.adj.to_dense().T)
    x = torch.randn(g.n_nodes, 5, dtype=torch.float32, requires_grad=True)
    w = torch.randn(g.n_nodes, 5)
    from trainer.recipes.kgat.model import SpMM
    (SpMM.apply(m.adj, m.adj_t, x) * w).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    ((m.adj.to_dense() @ x2) * w).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)


def test_column_panels_give_the_same_propagation_and_gradients():
    """Large graphs propagate in column panels on the CPU (SPMM_PANEL_BYTES); forced here onto the small
    graph with panels of 7 columns (some panels hold no edge of A or of A^T), it is the same function."""
    d, g = small_graph()
    whole, paneled = model_for(d, g, dropout=0.0), model_for(d, g, dropout=0.0)
    paneled.set_graph(g.heads, g.rels, g.tails, g.weights, panel_cols=7)
    assert isinstance(whole.products()[0], torch.Tensor)
    fwd, bwd = paneled.products()
    assert len(fwd) == len(bwd) == -(-g.n_nodes // 7) and sum(p._nnz() for p, _, _ in fwd) == len(g.heads)
    for m in (whole, paneled):
        m.refresh_attention()
        m.zero_grad()
        w = torch.randn(g.n_nodes, m.out_dim, generator=torch.Generator().manual_seed(1))
        (m.propagate() * w).sum().backward()
    assert torch.allclose(paneled.propagate(), whole.propagate(), atol=1e-6)
    grads = [(name, a.grad, b.grad) for (name, a), b in zip(whole.named_parameters(), paneled.parameters())
             if a.grad is not None or b.grad is not None]                    # propagation leaves relations out
    assert grads[0][0] == "embed" and len(grads) > 1
    for name, a, b in grads:
        assert torch.allclose(a, b, atol=1e-5), name
    with torch.no_grad():
        assert paneled.products(grad=False)[1] is None
        assert torch.allclose(paneled.propagate(), whole.propagate(), atol=1e-6)


def test_the_products_are_cached_until_the_attention_changes():
    d, g = small_graph()
    fresh, m = model_for(d, g), model_for(d, g)
    m.set_graph(g.heads, g.rels, g.tails, g.weights, panel_cols=7)
    def dense(a):
        if isinstance(a, torch.Tensor):
            return a.to_dense()
        return sum(torch.zeros(g.n_nodes, g.n_nodes).index_add_(1, torch.arange(lo, hi), p.to_dense())
                   for p, lo, hi in a)

    for model in (fresh, m):
        first = model.products()
        assert model.products()[0] is first[0]                       # a CF step reuses them
        before = dense(first[1]).clone()
        model.refresh_attention()                                     # a new propagation matrix
        now = model.products()
        if model is fresh:      # whole CSR matrices: the same ones, their values in place (a step graph holds them)
            assert now[0] is first[0] and now[1] is first[1]
        else:                   # column panels (CPU): made again
            assert now[0] is not first[0]
        assert torch.allclose(dense(now[0]), model.adj.to_dense()) and torch.allclose(dense(now[1]), dense(now[0]).T)
        assert not torch.allclose(dense(now[1]), before)
    m.load_state_dict(fresh.state_dict())                             # a load: the attention changes in place
    assert torch.allclose(dense(m.products()[0]), fresh.adj.to_dense())
    assert torch.allclose(dense(m.products()[1]), fresh.adj.to_dense().T)


def test_layer_input_raw_follows_the_original_and_normalized_the_ports():
    d, g = small_graph()
    raw, port = model_for(d, g, dropout=0.0), model_for(d, g, dropout=0.0, layer_input="normalized")
    port.load_state_dict(raw.state_dict())
    a, b = raw.propagate().detach(), port.propagate().detach()
    assert torch.equal(a[:, :16], b[:, :16])             # the ego embedding and the first layer agree
    assert not torch.allclose(a[:, 16:], b[:, 16:])      # the second layer reads a different input
    x = raw.aggregators[0](raw.embed, (raw.adj, None))   # what the port feeds layer 2: normalised layer 1
    expected = F.normalize(raw.aggregators[1](F.normalize(x, dim=1), (raw.adj, None)), dim=1)
    assert torch.allclose(b[:, 16:], expected.detach(), atol=1e-6)


@pytest.mark.parametrize("update", ["sparse", "dense"])
def test_the_gpu_shaped_projection_is_the_grouped_one(update):
    """project_fixed (one batched matmul, each row's W_r gathered: fixed shapes) gives project's KG loss and
    gradients (project groups the rows by relation: unique_consecutive and host reads)."""
    d, g = small_graph()
    grouped = model_for(d, g, kg_update=update)
    fixed = model_for(d, g, kg_update=update)
    fixed.gpu_shaped = True
    h, r, t = (torch.as_tensor(d.kg[:, k]) for k in (0, 1, 2))
    losses = [m("kg", h, r, t, torch.flip(t, (0,))) for m in (grouped, fixed)]
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(grouped.named_parameters(), fixed.parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert a.grad.is_sparse == b.grad.is_sparse == (name == "embed" and update == "sparse"), name
        assert torch.allclose(a.grad.to_dense(), b.grad.to_dense(), rtol=1e-5, atol=1e-8), name

"""KGAT (Wang et al., KDD 2019): attentive embedding propagation over the collaborative KG.

Follows the paper and its original code: TransR KG embeddings, attention pi(h,r,t) = (W_r e_t)^T
tanh(W_r e_h + e_r) normalised by a softmax over each head's edges (computed here on the model's device),
bi-interaction / GCN / GraphSAGE aggregators, message dropout, L2-normalised layer outputs, the final
representation the concatenation of every layer, BPR loss for CF and a TransR margin loss for the KG.
"""
from __future__ import annotations

import warnings
import zipfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipes.dropout import Dropout
from trainer.recipes.kernels import applies
from trainer.recipes.kernels import load as cpu_kernels
from trainer.recipes.kgat.config import KGATLossConfig, KGATModelConfig

# Rows per chunk when the attention refresh projects a relation's nodes (W_r e): the chunk's gathered rows,
# their projection and its tanh stay in the CPU's cache (4k x 64 floats = 1 MiB; whole relations at once ran
# the projection 1.7x slower at amazon-book's size). Edges per chunk of the PyTorch path's per-edge products,
# which write (edges, width) temporaries. A GPU takes larger chunks (fewer kernel launches).
PROJECT_CHUNK, ATTENTION_CHUNK, ATTENTION_CHUNK_GPU = 1 << 12, 1 << 14, 1 << 20
# A CSR product A @ x gathers rows of x at random; once x outgrows the CPU's last-level cache every gather
# misses. Split by columns into panels whose rows of x span at most this many bytes, each panel's gathers
# hit the cache and its product is added into the output in place: 2.4x faster at amazon-book's 184k nodes
# (47 MiB of embeddings) on a 32 MiB-L3 CPU. Embeddings that fit take one panel: the plain product.
SPMM_PANEL_BYTES = 8 << 20


def l2_mean(x: torch.Tensor) -> torch.Tensor:
    """The original code's L2 term: mean over rows of ||x||^2 / 2."""
    return (x.pow(2).sum(1) / 2).mean()


Panels = list  # [(CSR matrix of the columns lo:hi, lo, hi), ...]: A @ x = sum of panel @ x[lo:hi]


def panel_mm(a: torch.Tensor | Panels, x: torch.Tensor) -> torch.Tensor:
    """A @ x for A a CSR matrix or its column panels (each product added into the output in place)."""
    if isinstance(a, torch.Tensor):
        return torch.sparse.mm(a, x)
    (first, lo, hi), *rest = a
    out = torch.sparse.mm(first, x[lo:hi])
    for panel, lo, hi in rest:
        torch.addmm(out, panel, x[lo:hi], out=out)
    return out


def column_panels(rows: torch.Tensor, cols: torch.Tensor, n: int, panel_cols: int):
    """The edges (sorted by row) grouped into panels of panel_cols columns, rows still sorted inside each:
    (order: edge positions panel by panel, their columns local to the panel, int32; crow (P, n + 1), int32;
    each panel's first position). One panel: nothing to split (empty tensors)."""
    count = -(-n // panel_cols)
    if count <= 1:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty.int(), empty.int().reshape(0, n + 1), [0]
    panel = torch.div(cols, panel_cols, rounding_mode="floor")
    order = torch.argsort(panel, stable=True)
    starts = [0, *torch.bincount(panel, minlength=count).cumsum(0).tolist()]
    local = (cols - panel * panel_cols)[order].int()
    sorted_rows = rows[order]
    crow = torch.zeros(count, n + 1, dtype=torch.int32)
    for k in range(count):
        crow[k, 1:] = torch.bincount(sorted_rows[starts[k]:starts[k + 1]], minlength=n).cumsum(0)
    return order, local, crow, starts


def csr_matrix(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "sparse CSR support is in beta": mm is all we use
        return torch.sparse_csr_tensor(crow, col, values, shape)


def assemble_panels(values: torch.Tensor, layout: tuple, panel_cols: int, n: int) -> Panels:
    """The column panels of an n x n matrix from its per-edge values and column_panels' layout
    (edge order, local columns, crow per panel, each panel's first position)."""
    edge, col, crow, starts = layout
    values, out = values[edge], []
    for k in range(len(starts) - 1):
        lo, (a, b) = k * panel_cols, starts[k:k + 2]
        hi = min(lo + panel_cols, n)
        out.append((csr_matrix(crow[k], col[a:b], values[a:b], (n, hi - lo)), lo, hi))
    return out


def propagate(adj: tuple, x: torch.Tensor) -> torch.Tensor:
    """A @ x for adj = (A, A^T): SpMM, or edgewise_mm for a CUDA tensor under torch.use_deterministic_algorithms
    (train.deterministic): cuSPARSE's CSR product may add a row's terms in another order at every run, which
    torch does not refuse, and a resume was then not bitwise on a GPU."""
    if x.is_cuda and torch.are_deterministic_algorithms_enabled() and isinstance(adj[0], torch.Tensor):
        return edgewise_mm(adj[0], x)
    return SpMM.apply(adj[0], adj[1], x)


def edgewise_mm(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A @ x for a CSR A as a gather of x's rows and an index_add_ over the edges: both have deterministic CUDA
    kernels (forward and backward) under torch.use_deterministic_algorithms; an edge-sized buffer is the cost."""
    cols = a.col_indices().long()
    rows = torch._convert_indices_from_csr_to_coo(a.crow_indices(), cols)[0]
    return x.new_zeros(a.shape[0], x.shape[1]).index_add_(0, rows, x[cols] * a.values().unsqueeze(1))


class SpMM(torch.autograd.Function):
    """A @ x for a constant A (CSR or column panels) whose transpose is given too: the backward is A^T @ grad
    as one more product (torch's own backward for CSR transposes A on every call)."""

    @staticmethod
    def forward(ctx, adj: torch.Tensor | Panels, adj_t: torch.Tensor | Panels, x: torch.Tensor) -> torch.Tensor:
        ctx.adj_t = adj_t
        return panel_mm(adj, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, panel_mm(ctx.adj_t, grad.contiguous())


def sparse_softmax(scores: torch.Tensor, heads: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """Softmax of edge scores over the edges of each head, on the scores' device."""
    top = torch.full((n_nodes,), float("-inf"), device=scores.device, dtype=scores.dtype)
    top = top.scatter_reduce(0, heads, scores, reduce="amax", include_self=True)
    ex = (scores - top[heads]).exp()
    total = torch.zeros(n_nodes, device=scores.device, dtype=scores.dtype).index_add_(0, heads, ex)
    return ex / total[heads]


def head_softmax(scores: torch.Tensor, heads: torch.Tensor, crow: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """sparse_softmax for edges sorted by head (crow: the CSR row pointers): one C++ pass per head on float32 CPU
    tensors (kgat_kernels.inc's segment_softmax), the scatter softmax elsewhere."""
    ops = cpu_kernels() if applies(scores) else None
    return ops.segment_softmax(scores, crow) if ops is not None else sparse_softmax(scores, heads, n_nodes)


class Aggregator(nn.Module):
    """One propagation layer: combine e_h with its neighbourhood e_N = A e."""

    def __init__(self, kind: str, d_in: int, d_out: int, dropout: float, native_dropout: bool = False):
        super().__init__()
        self.kind = kind
        # a cheap mask: 1.11x the CF step at 23k nodes; torch's own in the GPU-shaped step (no host-read seed)
        self.dropout = Dropout(dropout, native_dropout)
        if kind == "gcn":
            self.w1 = nn.Linear(d_in, d_out)
        elif kind == "graphsage":
            self.w1 = nn.Linear(2 * d_in, d_out)
        elif kind == "bi-interaction":
            self.w1, self.w2 = nn.Linear(d_in, d_out), nn.Linear(d_in, d_out)
        else:
            raise ValueError(f"model.aggregator: unknown {kind!r} (bi-interaction, gcn, graphsage)")
        for lin in (m for m in self.modules() if isinstance(m, nn.Linear)):
            nn.init.xavier_uniform_(lin.weight)

    def forward(self, ego: torch.Tensor, adj: tuple) -> torch.Tensor:
        """adj: (A, A^T), each a CSR matrix or its column panels (KGAT.products)."""
        with torch.autocast(ego.device.type, enabled=False):    # sparse kernels are fp32 only (no bf16 CSR mm)
            side = propagate(adj, ego.float())
        if self.kind == "gcn":
            out = F.leaky_relu(self.w1(ego + side))
        elif self.kind == "graphsage":
            out = F.leaky_relu(self.w1(torch.cat([ego, side], 1)))
        else:
            out = F.leaky_relu(self.w1(ego + side)) + F.leaky_relu(self.w2(ego * side))
        return self.dropout(out)


class KGAT(nn.Module):
    """Node embeddings for entities (items first) and users (after the entities)."""

    def __init__(self, cfg: KGATModelConfig, n_entities: int, n_users: int, n_relations: int, n_edges: int = 0,
                 loss: KGATLossConfig | None = None, gpu_shaped: bool = False):
        super().__init__()
        # gpu_shaped: the GPU-shaped step's forms (fixed shapes, no host reads): native dropout, project_gathered
        self.cfg, self.n_entities, self.n_users, self.gpu_shaped = cfg, n_entities, n_users, gpu_shaped
        self.loss = loss if loss is not None else KGATLossConfig()
        self.n_nodes = n_entities + n_users
        self.embed = nn.Parameter(torch.empty(self.n_nodes, cfg.width))
        self.relation = nn.Parameter(torch.empty(n_relations, cfg.relation_width))
        self.trans = nn.Parameter(torch.empty(n_relations, cfg.width, cfg.relation_width))
        for p in (self.embed, self.relation, self.trans):
            nn.init.xavier_uniform_(p)
        dims = [cfg.width, *cfg.layer_widths]
        self.aggregators = nn.ModuleList(Aggregator(cfg.aggregator, dims[k], dims[k + 1], cfg.dropout, gpu_shaped)
                                         for k in range(len(cfg.layer_widths)))
        # The CKG (edges sorted by head) travels with the module (.to, DataParallel replicas) but is not
        # saved; the per-edge attention is saved, so a resumed run propagates with the same weights.
        self.register_buffer("crow", torch.zeros(self.n_nodes + 1, dtype=torch.int64), persistent=False)
        for name in ("heads", "rels", "tails"):
            self.register_buffer(name, torch.zeros(n_edges, dtype=torch.int64), persistent=False)
        self.register_buffer("crow_t", torch.zeros(self.n_nodes + 1, dtype=torch.int64), persistent=False)
        self.register_buffer("by_tail", torch.zeros(n_edges, dtype=torch.int64), persistent=False)
        self.register_buffer("by_rel", torch.zeros(n_edges, dtype=torch.int64), persistent=False)
        # the attention's relation runs (relation_runs): each run's distinct heads and tails, and every edge's
        # (in by_rel order) place among them
        for name in ("run_heads", "run_tails", "head_slot", "tail_slot"):
            self.register_buffer(name, torch.zeros(0, dtype=torch.int32), persistent=False)
        self.runs: list[tuple[int, int, int, int, int, int, int]] = []
        self.register_buffer("attention", torch.zeros(n_edges))
        # A and A^T in column panels (column_panels; empty when one panel holds all the columns)
        for name in ("p_edge", "p_col", "p_crow", "pt_edge", "pt_col", "pt_crow"):
            self.register_buffer(name, torch.zeros(0, dtype=torch.int64), persistent=False)
        self._panel_cols, self._p_starts, self._pt_starts = self.n_nodes, [0], [0]

    @property
    def out_dim(self) -> int:
        return self.cfg.width + sum(self.cfg.layer_widths)

    def load_pretrained(self, path: str, n_items: int) -> None:
        """BPR-MF embeddings (mf.npz: user_embed (U, D), item_embed (I, D)) as the initial node embeddings."""
        try:
            with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as mf:   # np.load's own would leak if damaged
                arrays = {k: torch.from_numpy(mf[k]) for k in mf.files if k in ("user_embed", "item_embed")}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:   # truncated, garbage, pickled
            raise ValueError(f"{path}: cannot be read as a .npz file ({type(err).__name__}: {err})") from None
        for key in ("user_embed", "item_embed"):
            if key not in arrays:
                raise ValueError(f"{path}: field {key!r} missing (expected user_embed and item_embed)")
        users, items = arrays["user_embed"], arrays["item_embed"]
        if users.shape != (self.n_users, self.cfg.width) or items.shape != (n_items, self.cfg.width):
            raise ValueError(f"{path}: user_embed {tuple(users.shape)} / item_embed {tuple(items.shape)} do not match "
                             f"({self.n_users}, {self.cfg.width}) / ({n_items}, {self.cfg.width})")
        with torch.no_grad():
            self.embed[self.n_entities:] = users
            self.embed[:n_items] = items

    def set_graph(self, heads: torch.Tensor, rels: torch.Tensor, tails: torch.Tensor, values: torch.Tensor,
                  panel_cols: int | None = None) -> None:
        """The CKG edges, sorted by head, and their initial propagation weights (the Laplacian); panel_cols
        columns per panel of the CPU products (default: SPMM_PANEL_BYTES of the widest embedding)."""
        if len(heads) != len(self.attention):
            raise ValueError(f"{len(heads)} edges given to a model built for {len(self.attention)}")
        if len(heads) and bool((heads[1:] < heads[:-1]).any()):
            raise ValueError("CKG edges must be sorted by head")
        dev = self.embed.device
        counts = torch.bincount(heads.cpu(), minlength=self.n_nodes)
        crow = torch.zeros(self.n_nodes + 1, dtype=torch.int64)
        crow[1:] = counts.cumsum(0)
        by_tail = torch.argsort(tails.cpu(), stable=True)       # the edges of A^T, row (tail) by row
        crow_t = torch.zeros(self.n_nodes + 1, dtype=torch.int64)
        crow_t[1:] = torch.bincount(tails.cpu(), minlength=self.n_nodes).cumsum(0)
        by_rel = torch.argsort(rels.cpu(), stable=True)           # the edges relation by relation, heads rising
        self.crow, self.heads, self.rels, self.tails, self.crow_t, self.by_tail, self.by_rel = (
            x.to(dev) for x in (crow, heads, rels, tails, crow_t, by_tail, by_rel))
        self.runs, *tables = relation_runs(heads.cpu()[by_rel], rels.cpu()[by_rel], tails.cpu()[by_rel], self.n_nodes)
        self.run_heads, self.run_tails, self.head_slot, self.tail_slot = (x.to(dev) for x in tables)
        widest = max(self.cfg.width, *self.cfg.layer_widths)
        self._panel_cols = panel_cols or max(1, SPMM_PANEL_BYTES // (4 * widest))
        heads, tails = heads.cpu(), tails.cpu()
        order, col, pcrow, self._p_starts = column_panels(heads, tails, self.n_nodes, self._panel_cols)
        order_t, col_t, pcrow_t, self._pt_starts = column_panels(tails[by_tail], heads[by_tail], self.n_nodes,
                                                                 self._panel_cols)
        self.p_edge, self.p_col, self.p_crow, self.pt_edge, self.pt_col, self.pt_crow = (
            x.to(dev) for x in (order, col, pcrow, by_tail[order_t], col_t, pcrow_t))
        self.set_attention(values)

    def set_attention(self, values: torch.Tensor) -> None:
        """New per-edge propagation weights (in place, so the buffer stays the one DDP and the state hold)."""
        self.attention.copy_(values.to(self.attention.device, self.attention.dtype))

    @property
    def adj(self) -> torch.Tensor:
        """A[h, t] = attention of edge (h, r, t), as a CSR matrix (a view on the buffers, built per call)."""
        return self._csr(self.crow, self.tails, self.attention)

    @property
    def adj_t(self) -> torch.Tensor:
        """A^T as a CSR matrix (for the backward pass of the propagation)."""
        return self._csr(self.crow_t, self.heads[self.by_tail], self.attention[self.by_tail])

    def _csr(self, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return csr_matrix(crow, col, values, (self.n_nodes, self.n_nodes))

    def products(self, grad: bool = True) -> tuple[torch.Tensor | Panels, torch.Tensor | Panels | None]:
        """(A, A^T when grad) for the propagation: column panels on the CPU once the embeddings outgrow
        SPMM_PANEL_BYTES (see there), whole CSR matrices otherwise (and on GPUs)."""
        # made again only when the attention changed (a refresh, a load: its version moves); a CF step propagates
        key = (self.attention.device, self.attention.data_ptr(), self.attention._version, len(self.p_edge))
        if getattr(self, "_products_key", None) != key:
            if self.embed.device.type != "cpu" or not len(self.p_edge):
                self._products = whole_products(self)
            else:
                self._products = tuple(
                    assemble_panels(self.attention, layout, self._panel_cols, self.n_nodes)
                    for layout in ((self.p_edge, self.p_col, self.p_crow, self._p_starts),
                                   (self.pt_edge, self.pt_col, self.pt_crow, self._pt_starts)))
            self._products_key = key
        return self._products[0], (self._products[1] if grad else None)

    def forward(self, phase: str, *batch: torch.Tensor) -> torch.Tensor:
        """The loss of a CF batch (users, pos, neg) or a KG batch (h, r, pos_t, neg_t)."""
        if phase not in ("cf", "kg"):
            raise ValueError(f"unknown KGAT phase {phase!r} (cf, kg)")
        return self.cf_loss(*batch) if phase == "cf" else self.kg_loss(*batch)

    def propagate(self) -> torch.Tensor:
        """Concatenation of the ego embedding and every layer's L2-normalised output: (n_nodes, out_dim)."""
        return torch.cat(self.layers(), 1)

    def layers(self) -> list[torch.Tensor]:
        """The ego embedding and every layer's L2-normalised output, each (n_nodes, its width)."""
        ego, outs = self.embed, [self.embed]
        adj = self.products(grad=torch.is_grad_enabled())
        for agg in self.aggregators:
            ego = agg(ego, adj)
            outs.append(F.normalize(ego, p=2, dim=1))
            if self.cfg.layer_input == "normalized":
                ego = outs[-1]
        return outs

    def cf_loss(self, users: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """BPR (softplus) on propagated embeddings, plus cf_l2 times their L2 term."""
        # the batch's rows gathered from each layer at once: the backward zero-fills each layer's gradient once,
        # where gathering users, positives and negatives from the concatenation filled an (n_nodes, out_dim)
        # gradient three times and added them (a third of a CF step at half amazon-book's size)
        idx = torch.cat([users + self.n_entities, pos, neg])
        u, p, n = torch.cat([layer[idx] for layer in self.layers()], 1).split(len(users))
        bpr = F.softplus((u * n).sum(1) - (u * p).sum(1)).mean()
        return bpr + self.loss.cf_l2 * (l2_mean(u) + l2_mean(p) + l2_mean(n))

    def kg_loss(self, h: torch.Tensor, r: torch.Tensor, pos_t: torch.Tensor, neg_t: torch.Tensor) -> torch.Tensor:
        """TransR: ||W_r e_h + e_r - W_r e_t||^2, positive below negative (softplus), plus kg_l2 L2."""
        r, hr, pr, nr = (project_gathered if self.gpu_shaped else KGAT.project)(self, r, h, pos_t, neg_t)
        rel = self.relation[r]
        pos_score = (hr + rel - pr).pow(2).sum(1)
        neg_score = (hr + rel - nr).pow(2).sum(1)
        loss = F.softplus(pos_score - neg_score).mean()
        return loss + self.loss.kg_l2 * (l2_mean(hr) + l2_mean(rel) + l2_mean(pr) + l2_mean(nr))

    def project(self, r: torch.Tensor, *nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(r, W_r e_n for each node list), rows grouped by relation: one matmul per relation present
        instead of gathering a (batch, d, d) stack of W_r (the losses are means, so order is free)."""
        order = torch.argsort(r, stable=True)
        r = r[order]
        rels, counts = torch.unique_consecutive(r, return_counts=True)
        idx = torch.stack([n[order] for n in nodes], 1)                           # (B, k, d): one gather
        # sparse: the table's gradient is the batch's rows, not a zero-filled table (cfg.kg_update)
        x = F.embedding(idx, self.embed, sparse=self.cfg.kg_update == "sparse")
        # unbind: one stack in the backward; indexing w[k] per relation made a zero-filled gradient of the
        # whole (relations, d, d_rel) stack per relation (80 memsets of 1.3 MB per KG step on amazon-book)
        w = self.trans.unbind(0)
        parts = [chunk @ w[k] for k, chunk in zip(rels.tolist(), x.split(counts.tolist()))]
        out = torch.cat(parts)                                                    # (B, k, d_rel)
        return (r, *out.unbind(1))

    @torch.no_grad()
    def refresh_attention(self, rank: int = 0, world: int = 1, gather=None) -> None:
        """Recompute pi for every edge and normalise it per head on the device: the new propagation matrix.
        With world > 1 this rank scores its share of the edges (balanced_bounds) and gather(part) returns
        every rank's part (each padded to one length), in rank order."""
        bounds = balanced_bounds(self.runs, world, len(self.heads))
        lo, hi = bounds[rank], bounds[rank + 1]
        scores = attention_scores(self, lo, hi)
        if world > 1:
            per = max(b - a for a, b in zip(bounds, bounds[1:]))
            parts = gather(F.pad(scores, (0, per - (hi - lo))))
            scores = torch.cat([part[:b - a] for part, a, b in zip(parts, bounds, bounds[1:])])
        pi = torch.empty_like(scores)
        pi[self.by_rel] = scores
        self.set_attention(head_softmax(pi, self.heads, self.crow, self.n_nodes))

    @torch.no_grad()
    def score_users(self, users: torch.Tensor, emb: torch.Tensor | None = None, n_items: int | None = None):
        """(len(users), n_items) scores u . i on propagated embeddings (items are nodes 0..n_items-1)."""
        emb = self.propagate() if emb is None else emb
        items = emb[: n_items or self.n_entities]
        return emb[users + self.n_entities] @ items.T


def project_gathered(model: KGAT, r: torch.Tensor, *nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """KGAT.project's result in batch order by one batched matmul with each row's W_r gathered (the GPU-shaped
    step's): fixed shapes and nothing read by the host (project sorts and splits by the relations present:
    unique_consecutive and two host reads per KG step, which a GPU waits for). Its gather costs a (batch, d, d_rel)
    stack, and its backward a scatter-add into the relations' stack: cheap on a GPU, where launches, not bytes,
    cost."""
    idx = torch.stack(nodes, 1)                                                   # (B, k)
    x = F.embedding(idx, model.embed, sparse=model.cfg.kg_update == "sparse")     # (B, k, d)
    out = torch.bmm(x, model.trans[r])                                            # (B, k, d_rel)
    return (r, *out.unbind(1))


def whole_products(model: KGAT) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, A^T) as whole CSR matrices. A's values are the attention buffer itself; A^T's are gathered in its
    order, into the tensor they were gathered into before where there is one: a step graph's captured products
    read those addresses, and the refresh at an epoch's end comes through here, outside any capture."""
    values_t = model.attention[model.by_tail]
    held, last = getattr(model, "_values_t", None), getattr(model, "_products", (None, None))
    if isinstance(last[0], torch.Tensor) and held is not None and held.shape == values_t.shape \
            and held.device == values_t.device:
        held.copy_(values_t)
        return last
    model._values_t = values_t
    return model.adj, model._csr(model.crow_t, model.heads[model.by_tail], values_t)


def relation_runs(heads: torch.Tensor, rels: torch.Tensor, tails: torch.Tensor, n_nodes: int):
    """For edges grouped by relation (heads rising within a relation, as KGAT.by_rel orders them): the runs
    [(relation, first edge, end, first head, end, first tail, end)], the distinct heads and tails of each run
    (run_heads, run_tails, run after run) and each edge's head and tail among its run's (head_slot, tail_slot),
    all int32. A node meets a relation on 2.3 edges on average (amazon-book), so projecting each (node,
    relation) once instead of each edge's two ends halves the refresh's arithmetic."""
    relations, lengths = torch.unique_consecutive(rels, return_counts=True)
    edge_start = F.pad(lengths.cumsum(0), (1, 0))
    tables, bounds = [], []
    for nodes, consecutive in ((heads, True), (tails, False)):
        key = rels.long() * n_nodes + nodes.long()
        distinct, slot = (torch.unique_consecutive if consecutive else torch.unique)(key, return_inverse=True)
        first = torch.searchsorted(distinct, relations.long() * n_nodes)          # each run's first distinct
        tables += [(distinct % n_nodes).int(), (slot - first.repeat_interleave(lengths)).int()]
        bounds.append(F.pad(first, (0, 1), value=len(distinct)).tolist())
    e, (h, t) = edge_start.tolist(), bounds
    runs = [(r, e[k], e[k + 1], h[k], h[k + 1], t[k], t[k + 1]) for k, r in enumerate(relations.tolist())]
    return runs, tables[0], tables[2], tables[1], tables[3]


# attention_scores' cost of a distinct head and of a distinct tail projected (the head's has the bias and tanh)
# against an edge's product, fitted on amazon-book's size at two ranks of one thread: 175-186, 115-117 and 25 ns
HEAD_COST, TAIL_COST = 7, 4.5


def balanced_bounds(runs: list[tuple[int, ...]], world: int, n: int) -> list[int]:
    """world + 1 edge positions (in by_rel order) that give every rank an equal share of attention_scores'
    cost: a user-item run has ~9 edges per distinct node, a KG run ~1.4, so equal edge counts left one of
    two ranks waiting 0.19 s of a 0.7 s refresh at amazon-book's size."""
    costs = [(e1 - e0) + HEAD_COST * (h1 - h0) + TAIL_COST * (t1 - t0) for _, e0, e1, h0, h1, t0, t1 in runs]
    total, bounds, done, k = sum(costs), [0], 0, 0
    for j in range(1, world):
        target = total * j / world
        while k < len(runs) and done + costs[k] <= target:
            done, k = done + costs[k], k + 1
        if k == len(runs):
            bounds.append(n)
            continue
        e0, e1 = runs[k][1], runs[k][2]
        bounds.append(max(bounds[-1], e0 + round((target - done) / costs[k] * (e1 - e0))))
    return bounds + [n]


def project(model: KGAT, nodes: torch.Tensor, r: int, tanh: bool) -> torch.Tensor:
    """W_r e_n for the nodes, or tanh(W_r e_n + e_r), in chunks of PROJECT_CHUNK rows on the CPU."""
    w, e_r = model.trans[r], model.relation[r]
    out = torch.empty(len(nodes), w.shape[1], device=w.device, dtype=w.dtype)
    chunk = PROJECT_CHUNK if w.device.type == "cpu" else max(len(nodes), 1)
    # one gather buffer for all chunks: a fresh 1 MiB index_select per chunk cost 3x the gather itself
    rows = model.embed.new_empty(min(chunk, len(nodes)), model.embed.shape[1])
    with torch.autocast(w.device.type, enabled=False):       # mm's out= is fp32, as the parameters
        for lo in range(0, len(nodes), chunk):
            part, ids = out[lo:lo + chunk], nodes[lo:lo + chunk]
            x = torch.index_select(model.embed, 0, ids, out=rows[:len(ids)])
            if tanh:
                torch.addmm(e_r, x, w, out=part).tanh_()      # the bias in the product: one pass less
            else:
                torch.mm(x, w, out=part)
    return out


@torch.no_grad()
def attention_scores(model: KGAT, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """pi(h,r,t) = (W_r e_t)^T tanh(W_r e_h + e_r) for the edges by_rel[lo:hi], in that order: per relation
    run, each distinct head and tail projected once (relation_runs), then one product per edge (the C++
    kernel's gather_dot on float32 CPU tensors, one pass; else gathered rows in chunks)."""
    hi = len(model.by_rel) if hi is None else hi
    out = torch.empty(hi - lo, device=model.embed.device, dtype=model.embed.dtype)
    ops = cpu_kernels() if applies(model.embed) else None
    for r, e0, e1, h0, h1, t0, t1 in model.runs:
        a, b = max(lo, e0), min(hi, e1)
        if a >= b:
            continue
        head_slot, tail_slot = model.head_slot[a:b], model.tail_slot[a:b]
        first = int(head_slot[0]) if a > e0 else 0        # heads rise within a run: a part of it uses a range
        heads = project(model, model.run_heads[h0 + first:h0 + int(head_slot[-1]) + 1], r, tanh=True)
        tails = project(model, model.run_tails[t0:t1], r, tanh=False)
        head_slot = head_slot - first if first else head_slot
        if ops is not None:
            out[a - lo:b - lo] = ops.gather_dot(tails, tail_slot, heads, head_slot)
            continue
        chunk = ATTENTION_CHUNK_GPU if out.device.type == "cuda" else ATTENTION_CHUNK
        for c in range(0, b - a, chunk):
            ts, hs = tail_slot[c:c + chunk].long(), head_slot[c:c + chunk].long()
            out[a - lo + c:a - lo + c + len(ts)] = (tails[ts] * heads[hs]).sum(1)
    return out

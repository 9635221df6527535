"""Sequential recommendation: TiSASRec+mHC by default; model.time=false -> SASRec+mHC,
model.mhc=false -> TiSASRec, both false -> SASRec.

    python -m trainer train --recipe sasrec --config configs/sasrec/ml-100k.yaml data.path=../shared/data/ml-100k
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from trainer.config.settings import refuse_ignored
from trainer.distributed import runtime
from trainer.engine.capabilities import (
    Batching,
    DataProvenance,
    DeviceResident,
    EpochPlan,
    Evaluation,
    GPUShapedStep,
    MemoryEstimate,
    Prediction,
)
from trainer.engine.loader import fits_on_device
from trainer.engine.recipe import Recipe, unwrap
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqLossConfig
from trainer.recipes.sasrec.device import DeviceSequences
from trainer.recipes.sasrec.losses import full_softmax_ce, real_shared_logits, shared_logits
from trainer.recipes.sasrec.model import MHCMaps, SeqRec
from trainer.recipes.sasrec.negatives import Sharing
from trainer.recipes.sasrec.negatives import log_q as log_q_of

KS = (5, 10, 20)


class SASRecRecipe(Recipe, Batching, DataProvenance, DeviceResident, EpochPlan, Evaluation, Prediction, MemoryEstimate,
                   GPUShapedStep):
    """Next-item prediction: BCE or a softmax on sampled negatives, or a softmax over every item (loss.kind)."""

    primary_metric = ("ndcg@10", "max")

    def build_datasets(self):
        d, e = self.data_cfg, self.eval_cfg
        self.data = D.load(d, getattr(self.dist, "local_rank", 0))
        self.split = D.Split(self.data)
        self.__dict__.pop("popularity", None)          # (the data's: counted again on first use)
        self.sharing = self._sharing()
        self.train_set = D.TrainSequences(self.split, d.maxlen, d.train_negatives, self.seed, self.sharing)
        evals = {name: D.EvalSequences(self.split, name, d.maxlen, e.negatives, self.seed, e.max_users)
                 for name in ("val", "test")}
        if len(evals["val"]) == 0:
            raise D.DataError(f"{d.path or 'synthetic data'}: no user has 3 or more interactions, so the "
                              f"validation and test splits are empty")
        return self.train_set, evals

    @functools.cached_property
    def popularity(self):
        """The training popularity of every item (data.popularity_scores), counted on first use: popularity sampling
        and logQ need it, a run with uniform negatives never reads it (a pass over every interaction at start-up)."""
        return D.popularity_scores(self.split)

    def _sharing(self) -> Sharing:
        """The negatives' plan, refusing settings that would be silently ignored (trainer/config/ignored.py)."""
        loss = self.loss_cfg or SeqLossConfig()          # (a recipe built for its data alone has no loss section)
        refuse_ignored(loss, "loss.")    # (configure() refused these before the run: a recipe built by hand here)
        return Sharing.of(loss, self.popularity if loss.negative_distribution == "popularity" else None)

    def build_model(self):
        return SeqRec(self.model_cfg, self.data.num_items, self.data_cfg.maxlen, fixed_shapes=self.gpu_shaped)

    def data_files(self):
        from trainer.recipes.sasrec.read import data_files, resolve_path
        return data_files(resolve_path(self.data_cfg.path).resolve()) if self.data_cfg.path else []

    def data_counts(self):
        lengths = self.data.seqs.lengths()
        return dict(users=len(lengths), items=self.data.num_items, interactions=int(lengths.sum()))

    def memory_drivers(self) -> str:
        return (f"the item count ({self.data.num_items:,}, data) x model.width={self.model_cfg.width}, and "
                f"model.depth={self.model_cfg.depth}")

    def device_dataset(self):
        """The GPU-shaped step's training set: padded rows and histories on the device, negatives drawn there
        (device.py) by the same stream as the DataLoader path's."""
        if not self.gpu_shaped:
            return None
        data = DeviceSequences(self.train_set, self.dist.torch_device)
        return data if fits_on_device(data.nbytes, self.dist.torch_device) else None

    def collate_fn(self):
        return D.collate

    def sample_costs(self):
        return self.train_set.lengths()

    def on_epoch_start(self, epoch, model):
        self.train_set.epoch = epoch          # negatives are drawn from (seed, epoch, user)
        self.maps = [m for m in unwrap(model).modules() if isinstance(m, MHCMaps)]
        for m in self.maps:
            m.reset_counts()

    def epoch_metrics(self):
        """mHC, over every rank: the mean number of Sinkhorn iterations a call ran (its slowest map's: at most
        model.mhc_sinkhorn_iters; each map stops once its rows are within model.mhc_sinkhorn_tol) and the
        largest row error left (|row sum - 1| of H_res: above the tolerance, maps that neither the iterations nor
        model.mhc_newton_steps brought within it)."""
        if not getattr(self, "maps", None):
            return {}
        device = runtime.comm_device(self.dist)
        counts = torch.tensor([[m.sinkhorn_iterations, m.sinkhorn_calls] for m in self.maps], dtype=torch.float64)
        counts = runtime.all_reduce(counts.sum(0).to(device), self.dist).cpu().tolist()
        errors = [m.sinkhorn_row_error for m in self.maps if m.sinkhorn_row_error is not None]
        worst = torch.stack(errors).amax().double().reshape(1) if errors else torch.zeros(1, dtype=torch.float64)
        worst = float(runtime.all_reduce(worst.to(device), self.dist, "max"))
        if not counts[1]:
            return {}
        return {"mhc_sinkhorn_iters": round(counts[0] / counts[1], 2), "mhc_row_error": float(f"{worst:.3g}")}

    def batch_size_of(self, batch):
        return int(batch["seq"].shape[0])

    def training_step(self, model, batch):
        if self.loss_cfg.kind == "ce":
            loss = self._full_ce(model, batch)
        elif self.sharing.shared:
            loss = self._shared_loss(model, batch)
        else:
            pos_logits, neg_logits = model(batch["seq"], batch["time"], batch["pos"], batch["neg"])
            loss = sequence_loss(pos_logits, neg_logits, batch["pos"], self.loss_cfg.kind,
                                 gbce_beta(neg_logits.shape[-1], self.data.num_items, self.loss_cfg.gbce_t))
        if self.loss_cfg.l2_emb > 0:
            loss = loss + self.loss_cfg.l2_emb * unwrap(model).item_emb.weight.pow(2).sum()
        return loss

    def _shared_loss(self, model, batch):
        """Shared negatives (loss.shared_negatives): the (B, T, D) features through the wrapped model's forward,
        scored against the batch's (B, K) negatives; logQ-corrected under sampled_softmax where the sampling is
        not uniform."""
        h = model(batch["seq"], batch["time"], None, None)
        weight = unwrap(model).item_emb.weight
        log_q = None
        if self.loss_cfg.kind == "sampled_softmax" and self.loss_cfg.logq and self.corrects:
            if getattr(self, "_log_q", None) is None or self._log_q.device != h.device:
                self._log_q = torch.from_numpy(log_q_of(self.popularity)).float().to(h.device)
            log_q = self._log_q
        pos, args = batch["pos"], (batch["neg"], batch["neg_seen"], self.sharing.mode, log_q)
        if self.gpu_shaped:                      # fixed shapes: every position, padding weighed 0
            pos_logits, neg_logits, neg_valid = shared_logits(h, weight, pos, *args)
        else:
            pos_logits, neg_logits, neg_valid, pos = real_shared_logits(h, weight, batch["seq"], pos, *args,
                                                                        buckets=self.model_cfg.length_buckets)
        beta = gbce_beta(neg_logits.shape[-1], self.data.num_items, self.loss_cfg.gbce_t)
        return sequence_loss(pos_logits, neg_logits, pos, self.loss_cfg.kind, beta, neg_valid)

    @property
    def corrects(self) -> bool:
        """Whether the negatives' proposal is not uniform (popularity or the batch's targets): what logQ fixes."""
        return self.sharing.mode == "in_batch" or self.sharing.popularity is not None

    def _full_ce(self, model, batch):
        """loss.kind=ce: the softmax over every item (item 0, the padding, left out) at each real position, the
        mean over them. The features come through the wrapped model's forward (DDP's hooks see it); on the
        GPU-shaped path every position is kept, padding weighed 0 (fixed shapes, no host sync)."""
        h = model(batch["seq"], batch["time"], None, None)
        pos, weight = batch["pos"], unwrap(model).item_emb.weight[1:]
        valid = pos != 0
        if self.gpu_shaped:
            scale = valid.reshape(-1).float() / valid.sum().clamp(min=1)
            return full_softmax_ce(h.reshape(-1, h.shape[-1]), weight, (pos - 1).clamp(min=0).reshape(-1), scale)
        rows = valid.nonzero(as_tuple=True)
        target = pos[rows] - 1
        return full_softmax_ce(h[rows], weight, target, torch.full(target.shape, 1.0 / max(len(target), 1),
                                                                    device=h.device))

    def eval_step(self, model, batch):
        model = unwrap(model)
        seq, time = batch["seq"], batch["time"]
        scores = model.score(seq, time, batch["candidates"]).float()
        rank = (scores[:, 1:] > scores[:, :1]).sum(1)                   # 0 = the target is first
        stats = {"count": torch.tensor(float(len(rank))), **rank_stats(rank, (10,), prefix="")}
        if self.eval_cfg.full_ranking:
            full = self.ranked_scores(model, seq, time, batch["history"])    # (the history holds no target)
            target_score = full.gather(1, batch["candidates"][:, :1])
            full_rank = (full > target_score).sum(1)
            stats.update(rank_stats(full_rank, KS, prefix="full_"))
        return stats

    @staticmethod
    def ranked_scores(model, seq, time, history=None) -> torch.Tensor:
        """(B, num_items + 1) scores of every item after each sequence, the padding item and each row's `history`
        (item ids, 0-padded) at -inf: what the full ranking ranks and `trainer predict` takes the top-K of."""
        full = model.score(seq, time).float()
        full[:, 0] = float("-inf")                                        # padding item
        if history is not None:
            full.scatter_(1, history, float("-inf"))                      # seen items are not ranked
        return full

    predict_unit_name = "users"

    def predict_units(self, request):
        from trainer.recipes.sasrec import predict
        return predict.units(self, request)

    def predict_rows(self, model, units, request):
        from trainer.recipes.sasrec import predict
        return predict.rows(self, model, units, request)

    def metric_names(self):
        zero = torch.zeros(1)
        full = rank_stats(zero, KS, prefix="full_") if self.eval_cfg.full_ranking else {}
        return set(self.compute_metrics({"count": torch.tensor(1.0), **rank_stats(zero, (10,), prefix=""), **full}))

    def compute_metrics(self, totals):
        n = max(float(totals["count"]), 1.0)
        out = {k: float(v) / n for k, v in totals.items() if k != "count"}
        for k in KS:                       # one held-out item per user: recall@k equals the hit rate
            if f"full_hr@{k}" in out:
                out[f"full_recall@{k}"] = out[f"full_hr@{k}"]
        out["users"] = int(totals["count"])
        return out


def gbce_beta(negatives: int, items: int, t: float) -> float:
    """gSASRec's beta (Petrov & Macdonald, RecSys 2023): alpha = negatives / (items - 1), the sampling rate, and
    beta = alpha (t (1 - 1/alpha) + 1/alpha): t = 0 gives 1 (plain BCE), t = 1 gives alpha."""
    alpha = negatives / max(items - 1, 1)
    return alpha * (t * (1 - 1 / alpha) + 1 / alpha)


def sequence_loss(pos_logits: torch.Tensor, neg_logits: torch.Tensor, pos: torch.Tensor,
                  kind: str = "bce", beta: float = 1.0, neg_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss over the real positions (pos != 0): BCE on the positive and its sampled negatives,
    a softmax over them (loss.kind=sampled_softmax), or gSASRec's gBCE: BCE whose positive probability is raised
    to `beta` (-beta log sigmoid(s+), the same as its transformed logit's BCE), averaged over the positive and
    negative terms together, as gSASRec does. neg_valid (shared negatives): the negatives that count."""
    valid = (pos != 0).float()
    count = valid.sum().clamp(min=1)
    pos_logits, neg_logits = pos_logits.float(), neg_logits.float()
    if neg_valid is not None:
        return _masked_loss(pos_logits, neg_logits, valid, count, kind, beta, neg_valid)
    if kind == "gbce":
        terms = beta * F.softplus(-pos_logits) + F.softplus(neg_logits).sum(-1)
        return (terms * valid).sum() / (count * (1 + neg_logits.shape[-1]))
    if kind == "bce":      # mean over real positions (and their negatives)
        pos_loss = (F.softplus(-pos_logits) * valid).sum() / count
        neg_loss = (F.softplus(neg_logits) * valid.unsqueeze(-1)).sum() / (count * neg_logits.shape[-1])
        return pos_loss + neg_loss
    logits = torch.cat([pos_logits.unsqueeze(-1), neg_logits], -1)
    return ((torch.logsumexp(logits, -1) - pos_logits) * valid).sum() / count


def _masked_loss(pos_logits, neg_logits, valid, count, kind, beta, neg_valid):
    """sequence_loss where some negatives do not count: out of the softmax, out of BCE's sums and means."""
    keep = neg_valid.float() * valid.unsqueeze(-1)
    if kind == "gbce":
        terms = (beta * F.softplus(-pos_logits) * valid).sum() + (F.softplus(neg_logits) * keep).sum()
        return terms / (count + keep.sum())
    if kind == "bce":
        return (F.softplus(-pos_logits) * valid).sum() / count + \
            (F.softplus(neg_logits) * keep).sum() / keep.sum().clamp(min=1)
    logits = torch.cat([pos_logits.unsqueeze(-1), neg_logits.masked_fill(~neg_valid, float("-inf"))], -1)
    return ((torch.logsumexp(logits, -1) - pos_logits) * valid).sum() / count


def rank_stats(rank: torch.Tensor, ks, prefix: str) -> dict[str, torch.Tensor]:
    """Sums of HR@k and NDCG@k over a batch, given the 0-based rank of each target."""
    out = {}
    for k in ks:
        hit = rank < k
        out[f"{prefix}hr@{k}"] = hit.sum().double()
        out[f"{prefix}ndcg@{k}"] = (hit.double() / torch.log2(rank.double() + 2)).sum()
    return out



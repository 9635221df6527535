"""KGAT on the collaborative knowledge graph: an epoch is a CF phase, a KG phase and an attention refresh.

    python -m trainer data convert movielens-kg --src ../shared/data/ml-100k --out data/ml-100k-kg
    python -m trainer train --recipe kgat --config configs/kgat/ml-100k-kg.yaml data.path=data/ml-100k-kg
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from trainer.distributed import runtime
from trainer.engine import capabilities as can
from trainer.engine.loader import per_rank_batch_size
from trainer.engine.optim import optimizer_spec, phased, sparse_rows
from trainer.engine.recipe import Recipe, unwrap
from trainer.recipes.kernels import load as cpu_kernels
from trainer.recipes.kgat import convert
from trainer.recipes.kgat import data as D
from trainer.recipes.kgat.config import KGATDataConfig
from trainer.recipes.kgat.device import DeviceTables
from trainer.recipes.kgat.metrics import finalize, metric_names, sums_from_hits
from trainer.recipes.kgat.model import KGAT
from trainer.recipes.kgat.sampling import EpochPlan, PhaseSampler, batch_entries, csr, hits_of

log = logging.getLogger(__name__)
SPLITS = ("val", "test")


class Users(torch.utils.data.Dataset):
    """The users of an evaluation split (those with items in it), tagged with the split's index."""

    def __init__(self, sets: list[np.ndarray], split_index: int):
        self.users = [u for u, items in enumerate(sets) if len(items)]
        self.split_index = split_index

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.users[i], self.split_index


class Interactions(torch.utils.data.Dataset):
    """The training (user, item) pairs; KGAT samples its batches itself (epoch_batches)."""

    def __init__(self, data: D.KGATData):
        self.users, self.items = data.pairs("train")

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return int(self.users[i]), int(self.items[i])


def load_data(cfg: KGATDataConfig, local_rank: int = 0) -> D.KGATData:
    """The folder at cfg.path (KGAT format, through the data cache), or synthetic data; with the validation
    hold-out."""
    if cfg.path:
        data = D.load_cached(cfg.path, cfg.duplicates, cfg.cache, local_rank, cfg.remap_ids,
                             (cfg.user_column, cfg.item_column), cfg.cache_cap_gb)
    else:
        stats = convert.Stats(cfg.synthetic_users, cfg.synthetic_items, cfg.synthetic_entities,
                            cfg.synthetic_relations, cfg.synthetic_triples, cfg.synthetic_interactions)
        data = convert.synthesize(stats, cfg.synthetic_seed)
    return D.hold_out_validation(data, cfg.val_fraction, cfg.split_seed)


class KGATRecipe(Recipe, can.Batching, can.DataProvenance, can.EpochPlan, can.Evaluation, can.Prediction,
                 can.MemoryEstimate, can.DDPPolicy, can.GPUShapedStep, can.OwnOptimizer):
    """BPR on propagated embeddings (CF phase) and TransR (KG phase), attention refreshed every epoch."""

    primary_metric = ("recall@20", "max")
    # the CF loss leaves the TransR parameters out, the KG loss the layers, and the node table's gradient is dense
    # in one phase and a few rows in the other: rather than DDP (its search for unused parameters, a used-parameter
    # map, two synchronisations per step), the loop averages every gradient in one all-reduce after the backward,
    # the table's rows gathered in the KG phase (no DDP, so no buffer broadcast either: the graph's buffers are
    # built alike on every rank, and the ranks refresh the attention together once per epoch, below)
    average_after_backward = True

    def id_maps(self):
        return dict(self.data.id_maps or {})

    def build_datasets(self):
        self.data = load_data(self.data_cfg, getattr(self.dist, "local_rank", 0))
        if self.data.val is None:
            log.warning("data.val_fraction=0: the test split is also used for early stopping and best.pt")
        self.ckg = D.build_ckg(self.data, self.data_cfg.laplacian)
        self.sampler = PhaseSampler(self.data, self.ckg)
        # the GPU-shaped step: every batch drawn on the device (device.py; not `tables`, the evaluation's)
        self.device_tables = DeviceTables(self.sampler, self.dist.torch_device) if self.gpu_shaped else None
        if self.train_cfg.grad_accum_steps != 1:
            raise ValueError("kgat: train.grad_accum_steps must be 1 (each step is one CF or KG batch; "
                             "raise --batch-size instead)")
        self.cf_batch = per_rank_batch_size(self.train_cfg, self.dist.world_size, self.dist.replicas)
        self.kg_batch = self.data_cfg.kg_batch_size or 2 * self.cf_batch
        known_val = self.data.train
        known_test = [np.union1d(a, b) for a, b in zip(self.data.train, self.data.val)] \
            if self.data.val is not None else self.data.train
        val = self.data.val if self.data.val is not None else self.data.test
        self.eval_tables = [(csr(known_val), csr(val)), (csr(known_test), csr(self.data.test))]
        self._plan: EpochPlan | None = None
        self._reset_epoch_stats()
        log.info("kgat: %d users, %d items, %d entities, %d CKG edges, %d relations (with inverses); "
                 "CF %d + KG %d steps per epoch", self.data.n_users, self.data.n_items, self.data.n_entities,
                 len(self.ckg.heads), self.ckg.n_relations, *self._steps())
        return Interactions(self.data), {"val": Users(val, 0), "test": Users(self.data.test, 1)}

    def _steps(self) -> tuple[int, int]:
        plan = self.epoch_batches(0)
        return plan.n_cf_steps, plan.n_kg_steps

    def build_model(self):
        m = self.model_cfg
        if m.kg_update == "sparse" and (self.optim_cfg.name == "sgd" or self.dist.replicas > 1):
            log.info("kgat: model.kg_update=dense (sparse row updates need Adam/AdamW and one device per process)")
            m = self.model_cfg = replace(m, kg_update="dense")
        model = KGAT(m, self.data.n_entities, self.data.n_users, self.ckg.n_relations, len(self.ckg.heads),
                     loss=self.loss_cfg, gpu_shaped=self.gpu_shaped)
        model.set_graph(self.ckg.heads, self.ckg.rels, self.ckg.tails, self.ckg.weights)
        if m.pretrain:
            model.load_pretrained(m.pretrain, self.data.n_items)
        return model

    def data_files(self):
        folder = Path(self.data_cfg.path) if self.data_cfg.path else None
        return [folder / name for name in D.FILES if (folder / name).exists()] if folder else []

    def data_counts(self):
        d = self.data
        return dict(users=d.n_users, items=d.n_items, entities=d.n_entities, relations=d.n_relations,
                    interactions=int(sum(len(x) for x in d.train)) if isinstance(d.train, list) else len(d.train.flat),
                    triples=len(d.kg))

    def model_for_estimate(self):
        with torch.device("meta"):          # the graph's buffers are sized here too; set_graph fills them
            return KGAT(self.model_cfg, self.data.n_entities, self.data.n_users, self.ckg.n_relations,
                        len(self.ckg.heads), loss=self.loss_cfg, gpu_shaped=self.gpu_shaped)

    def optimizer_states(self) -> int:
        return super().optimizer_states() * (1 if self.model_cfg.phase_optimizers == "shared" else 2)

    def memory_drivers(self) -> str:
        return (f"the node count ({self.data.n_entities + self.data.n_users:,} entities and users: the data's "
                f"largest ids + 1; data.remap_ids=true compacts sparse ids) x model.width={self.model_cfg.width}")

    def build_optimizer(self, model, lr):
        cls, kwargs = optimizer_spec(self.optim_cfg, lr)
        if self.model_cfg.kg_update == "sparse":
            # the C++ row update where the kernels are built; fixed shapes, no host read on the GPU-shaped step
            cls = sparse_rows(cls, cpu_kernels(), fixed=self.gpu_shaped)
        if self.model_cfg.phase_optimizers == "shared":
            self.optimizer = cls(model.parameters(), **kwargs)
        else:
            self.optimizer = phased(cls)(model.parameters(), phases=("cf", "kg"), **kwargs)
        return self.optimizer

    def epoch_batches(self, epoch):
        if self._plan is None or self._plan.epoch != epoch:
            sampler = self.sampler if self.device_tables is None else self.device_tables
            self._plan = EpochPlan(sampler, epoch, self.seed, self.dist.rank, self.dist.world_size, self.cf_batch,
                                   self.kg_batch)
        return self._plan

    def batch_size_of(self, batch):
        return int(batch["tensors"][0].shape[0])

    # ------------------------------------------------------------------------------------------ training
    def _reset_epoch_stats(self) -> None:
        # per phase: the loss sum on the device (read at the epoch's end; zeroed in place: a step graph adds to it)
        self.loss_sums: dict[str, torch.Tensor] = getattr(self, "loss_sums", {})
        for total in self.loss_sums.values():
            total.zero_()
        self.loss_counts = {"cf": 0, "kg": 0}
        self.phase_start: dict[str, float] = {}

    def before_step(self, batch):
        phase = batch["phase"]
        self.phase_start.setdefault(phase, time.perf_counter())
        if hasattr(self.optimizer, "set_phase"):
            self.optimizer.set_phase(phase)
        # the host's part of the step (a step graph replays only the device's): the samples, the sum's tensor
        self.loss_counts[phase] += self.batch_size_of(batch)
        if phase not in self.loss_sums:
            self.loss_sums[phase] = torch.zeros((), dtype=torch.float64, device=batch["tensors"][0].device)

    def training_step(self, model, batch):
        phase = batch["phase"]
        loss = model(phase, *batch["tensors"])
        loss = loss.mean() if loss.dim() else loss            # DataParallel returns one loss per replica
        self.loss_sums[phase].add_(loss.detach().double() * self.batch_size_of(batch))
        return loss

    def on_epoch_start(self, epoch, model):
        self._reset_epoch_stats()

    def on_epoch_end(self, epoch, model):
        t0 = time.perf_counter()
        self.phase_time = {p: t0 - t for p, t in self.phase_start.items()}
        if "kg" in self.phase_time and "cf" in self.phase_time:
            self.phase_time["cf"] -= self.phase_time["kg"]
        m = unwrap(model)
        # every rank scores its share of the edges; the softmax over all of them then runs on every rank
        m.refresh_attention(self.dist.rank, self.dist.world_size, lambda part: runtime.all_gather(part, self.dist))
        if m.embed.is_cuda or runtime.local_comm() is None:
            # the same scores give the same attention, but a GPU's scatter order (or another host's CPU) may
            # differ in the last bits: rank 0's is everyone's
            runtime.broadcast(m.attention, self.dist)
        m.products()            # A^T's values follow the new attention now, outside any step graph's capture
        if m.embed.is_cuda:
            torch.cuda.synchronize()
        self.phase_time["attention"] = time.perf_counter() - t0

    def epoch_metrics(self):
        device = runtime.comm_device(self.dist)
        sums = torch.zeros(4, dtype=torch.float64, device=device)     # cf sum, cf count, kg sum, kg count
        for k, phase in ((0, "cf"), (2, "kg")):
            if self.loss_counts[phase]:
                sums[k] = self.loss_sums[phase].to(device)
            sums[k + 1] = self.loss_counts[phase]
        sums = runtime.all_reduce(sums, self.dist).cpu().tolist()
        out = {f"{p}_time_s": round(t, 4) for p, t in self.phase_time.items()}
        if sums[1]:
            out["cf_loss"] = sums[0] / sums[1]
        if sums[3]:
            out["kg_loss"] = sums[2] / sums[3]
        return out

    # ------------------------------------------------------------------------------------------ evaluation
    def on_evaluation_start(self, model):
        m = unwrap(model)
        self.emb, dev = m.propagate(), m.embed.device
        self.tables = [tuple(tuple(torch.from_numpy(x).to(dev) for x in t) for t in pair)
                       for pair in self.eval_tables]

    def on_evaluation_end(self):
        self.emb = self.tables = None

    def eval_step(self, model, batch):
        users, split = batch[0], int(batch[1][0])
        (known_ptr, known_idx), (test_ptr, test_idx) = self.tables[split]
        n_items, scores = self.data.n_items, self.user_scores(self.emb, users)
        scores[batch_entries(known_ptr, known_idx, users)] = float("-inf")     # trained-on items are not ranked
        top = scores.topk(min(max(self.eval_cfg.ks), n_items), dim=1).indices
        n_test = test_ptr[users + 1] - test_ptr[users]
        return sums_from_hits(hits_of(test_ptr, test_idx, users, top, n_items), n_test, tuple(self.eval_cfg.ks),
                              self.eval_cfg.ndcg)

    def user_scores(self, emb: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        """(B, items) scores of every item for these users from the propagated embeddings: what the evaluation ranks
        and `trainer predict` takes the top-K of."""
        return (emb[users + self.data.n_entities] @ emb[:self.data.n_items].T).float()

    def metric_names(self):
        return metric_names(tuple(self.eval_cfg.ks), self.eval_cfg.ndcg)

    def compute_metrics(self, totals):
        return finalize(totals)

    predict_unit_name = "users"

    def predict_units(self, request):
        from trainer.recipes.kgat import predict
        return predict.units(self, request)

    def predict_rows(self, model, units, request):
        from trainer.recipes.kgat import predict
        return predict.rows(self, model, units, request)

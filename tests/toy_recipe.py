"""A test-only recipe: a small MLP regressing a noisy linear target on synthetic data.

Loaded through TRAINER_PLUGINS=tests.toy_recipe. Its data section can make the process signal
itself at a given training step, so preemption tests use the real signal path deterministically.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from trainer.config.bounds import FRACTION, POSITIVE, Bound
from trainer.config.registry import register
from trainer.config.spec import RecipeSpec
from trainer.engine.capabilities import EpochPlan, Prediction
from trainer.engine.recipe import Recipe


@dataclass
class ToyDataConfig:
    """Synthetic regression data, plus test hooks."""

    bounds: ClassVar[dict[str, Bound]] = dict(n_train=POSITIVE, n_val=POSITIVE, n_test=POSITIVE, features=POSITIVE,
                                              signal_rank=Bound(-1))
    path: str = ""
    n_train: int = 256
    n_val: int = 61               # odd on purpose: uneven evaluation shards
    n_test: int = 37
    features: int = 8
    noise: float = 0.1
    data_seed: int = 1234
    signal_at_step: int = 0       # send self_signal at this training step of this process (0: never)
    signal_name: str = "SIGTERM"
    signal_rank: int = 0          # which rank signals itself (-1: every rank)
    signal_workers: bool = False  # also signal this process's children (DataLoader workers), as Slurm does
    step_sleep: float = 0.0       # seconds per training step, to keep a job running long enough
    nan_at_step: int = 0          # the loss of this training step of this process is NaN (0: never)
    nan_rank: int = 0             # which rank sees it
    crash_at_step: int = 0        # this process dies at this training step (0: never), on the launches below:
    crash_attempts: int = 1       # while the restart attempt (TRAINER_ATTEMPT / TORCHELASTIC_RESTART_COUNT) is lower
    crash_rank: int = 0
    crash_how: str = "kill"       # kill: SIGKILL itself (no exit record); raise: an uncaught exception (exit 1);
    # stop: SIGSTOP itself (a hung rank: alive, silent, its threads stopped too)
    log_ids: str = ""             # append "epoch rank id id ..." per training batch to this file (exact resume tests)


@dataclass
class ToyModelConfig:
    """Two-layer MLP."""

    bounds: ClassVar[dict[str, Bound]] = dict(hidden=POSITIVE, dropout=FRACTION)
    hidden: int = 16
    dropout: float = 0.1


class ToyMLP(torch.nn.Module):
    """features -> hidden -> 1."""

    def __init__(self, features: int, cfg: ToyModelConfig):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, cfg.hidden), torch.nn.ReLU(),
                                       torch.nn.Dropout(cfg.dropout), torch.nn.Linear(cfg.hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def make_split(n: int, features: int, noise: float, seed: int) -> torch.utils.data.TensorDataset:
    """y = x . w + noise with a fixed w; a different seed per split."""
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1.0, 1.0, features)
    x = torch.randn(n, features, generator=g)
    y = x @ w + noise * torch.randn(n, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _fail_before_rendezvous() -> None:
    """Test hook: the rank named by TOY_FAIL_RANK fails while its config is built, before the process group
    forms (as a node that cannot read its config or data would); the other ranks then wait in the rendezvous."""
    rank = os.environ.get("SLURM_PROCID") if os.environ.get("SUBMITIT_EXECUTOR") else os.environ.get("RANK")
    if os.environ.get("TOY_FAIL_RANK") and rank == os.environ["TOY_FAIL_RANK"]:
        raise RuntimeError(f"toy: rank {rank} fails before the rendezvous (TOY_FAIL_RANK)")


def _toy_model_config() -> ToyModelConfig:
    _fail_before_rendezvous()
    return ToyModelConfig()


class ToyRecipe(Recipe, EpochPlan, Prediction):
    """Regression with MSE; primary metric val mse (lower is better)."""

    primary_metric = ("mse", "min")

    def build_datasets(self):
        d = self.data_cfg
        self.steps_seen = 0
        train = make_split(d.n_train, d.features, d.noise, d.data_seed)
        train = torch.utils.data.TensorDataset(*train.tensors, torch.arange(d.n_train))   # + each sample's id
        evals = {"val": make_split(d.n_val, d.features, d.noise, d.data_seed + 1),
                 "test": make_split(d.n_test, d.features, d.noise, d.data_seed + 2)}
        return train, evals

    def build_model(self):
        return ToyMLP(self.data_cfg.features, self.model_cfg)

    def training_step(self, model, batch):
        self._test_hooks()
        x, y, ids = batch
        if self.data_cfg.log_ids:
            with open(self.data_cfg.log_ids, "a") as fh:
                fh.write(f"{self.epoch} {self.dist.rank} {' '.join(map(str, ids.tolist()))}\n")
        loss = torch.nn.functional.mse_loss(model(x), y)
        d = self.data_cfg
        if d.nan_at_step and self.steps_seen == d.nan_at_step and self.dist.rank == d.nan_rank:
            loss = loss * float("nan")
        return loss

    def _test_hooks(self) -> None:
        d = self.data_cfg
        self.steps_seen += 1
        if d.step_sleep:
            time.sleep(d.step_sleep)
        if d.signal_at_step and self.steps_seen == d.signal_at_step and d.signal_rank in (-1, self.dist.rank):
            sig = getattr(signal, d.signal_name)
            if d.signal_workers:
                import psutil
                children = psutil.Process().children(recursive=True)
                assert children, "signal_workers: no worker processes (train.num_workers=0?)"
                for child in children:
                    os.kill(child.pid, sig)
            os.kill(os.getpid(), sig)
        if d.crash_at_step:
            self._crash_hook()

    def _crash_hook(self) -> None:
        d = self.data_cfg
        attempt = max(int(os.environ.get(name) or 0) for name in ("TRAINER_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"))
        if self.steps_seen != d.crash_at_step or self.dist.rank != d.crash_rank or attempt >= d.crash_attempts:
            return
        if d.crash_how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if d.crash_how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        raise RuntimeError(f"toy: rank {self.dist.rank} crashes at step {self.steps_seen} (injected)")

    def on_epoch_start(self, epoch, model):
        self.epoch = epoch

    def eval_step(self, model, batch):
        x, y = batch
        err = (model(x).double() - y.double()) ** 2   # float64 sums: independent of sharding order
        return {"sq_err": err.sum(), "count": torch.tensor(float(len(y)))}

    def compute_metrics(self, totals):
        return {"mse": float(totals["sq_err"] / totals["count"]), "count": int(totals["count"])}

    # `trainer predict` on the test split's rows: its machinery (parts, ranks, requeue) with a sleep per part
    predict_unit_name = "rows"

    def predict_units(self, request):
        return list(range(self.data_cfg.n_test))

    def predict_rows(self, model, units, request):
        if self.data_cfg.step_sleep:
            time.sleep(self.data_cfg.step_sleep)
        x = make_split(self.data_cfg.n_test, self.data_cfg.features, self.data_cfg.noise,
                       self.data_cfg.data_seed + 2).tensors[0][units]
        y = model(x).reshape(len(units), -1)[:, 0]
        return {"row": units, "rank": [self.dist.rank] * len(units), "y": y.tolist()}


register(RecipeSpec(name="toy", recipe=ToyRecipe, summary="test-only MLP regression", data_config=ToyDataConfig,
                    model_config=_toy_model_config,
                    resume_changeable=("data.signal_*", "data.step_sleep", "data.nan_*", "data.log_ids")))

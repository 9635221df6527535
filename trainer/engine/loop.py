"""The generic training loop: one code path for single process, DataParallel and DDP.

    result = fit(recipe, dist_info, cfg)   # cfg: trainer.config.Config; see trainer/__main__.py
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config import Config, to_dict
from trainer.distributed import runtime
from trainer.distributed.runtime import DistInfo
from trainer.engine import checkpoint as ckpt_io
from trainer.engine import syncwait
from trainer.engine.data import ResumableSampler, make_loader, per_rank_batch_size
from trainer.engine.evaluation import evaluate
from trainer.engine.logging import MetricsWriter, progress_bar
from trainer.engine.metrics import SystemStats, Throughput
from trainer.engine.optim import build_optimizer, build_scheduler, scaled_lr
from trainer.engine.preemption import PreemptionHandler
from trainer.engine.recipe import Recipe, move_to

log = logging.getLogger(__name__)
MAX_STEPS = -1  # pseudo-signal: the step budget is spent


class NonFiniteLossError(ArithmeticError):
    """The training loss became NaN or infinite; the message names the step and the last good checkpoint."""
PREEMPTED_MARKER = ".preempted"   # in the run directory while the last stop was a signal checkpoint


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0
    batch_in_epoch: int = 0       # micro-batches this rank consumed in `epoch`
    global_step: int = 0          # optimizer steps
    best: float | None = None     # best value of the primary validation metric
    best_tie: float | None = None  # the recipe's tie-break metric at that evaluation
    bad_epochs: int = 0           # evaluations without improvement (early stopping)


@dataclass
class FitResult:
    """What fit() reports to its caller."""

    status: str                   # completed | preempted | early_stopped
    signal: int = 0
    requeued: bool = False
    global_step: int = 0
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)


def rank_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from (seed, rank, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) generators."""
    import random
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def wrap_model(model: torch.nn.Module, info: DistInfo, dist_cfg, find_unused: bool = False,
               broadcast_buffers: bool = True) -> torch.nn.Module:
    """DDP for a world > 1, DataParallel for --strategy dp on several GPUs, else the plain module."""
    if info.distributed:
        if dist_cfg.strategy != "ddp":
            raise ValueError(f"--strategy {dist_cfg.strategy} with a world of {info.world_size} processes.\n"
                             f"HINT: use --strategy ddp under srun/torchrun, or launch one process.")
        ids = [info.torch_device.index] if info.device.startswith("cuda") else None
        return DDP(model, device_ids=ids, find_unused_parameters=dist_cfg.find_unused_parameters or find_unused,
                   forward_sync_buffers=broadcast_buffers)
    if dist_cfg.strategy == "dp":
        if len(info.dp_devices) < 2:
            log.warning("--strategy dp needs two or more CUDA devices (%s): using one device (%s)",
                        f"--gpu-ids {list(info.dp_devices)}" if info.dp_devices else "no CUDA here", info.device)
            return model
        return torch.nn.DataParallel(model, device_ids=list(info.dp_devices))
    return model


def better(value: float, than: float, mode: str) -> bool:
    """value beats than under mode 'min' or 'max'."""
    return value < than if mode == "min" else value > than


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype of --amp on this device; auto: bf16 where the GPU supports it, else fp16; None on CPU."""
    if mode == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


class Loop:
    """One training run; small methods over shared state."""

    def __init__(self, recipe: Recipe, info: DistInfo, cfg: Config):
        self.recipe, self.info, self.cfg, self.tc = recipe, info, cfg, cfg.train
        self.run_dir = Path(cfg.run_dir)
        self.device = info.torch_device
        self.state = TrainState()
        self.ckpts = ckpt_io.CheckpointManager(self.run_dir, cfg.ckpt.keep_last)
        self.writer = MetricsWriter(self.run_dir, info, self.tc.tensorboard)
        self.stats, self.meter = SystemStats(), Throughput()
        self.last_metrics: dict[str, dict[str, Any]] = {}
        self.last_records: dict[str, dict[str, Any]] = {}   # as written to metrics.jsonl
        self._setup()

    # ---------------------------------------------------------------- set-up
    def _setup(self) -> None:
        cfg, info = self.cfg, self.info
        self.batch_size = per_rank_batch_size(self.tc, info.world_size, info.replicas)
        self.accum = max(self.tc.grad_accum_steps, 1)
        seed_everything(cfg.seed)  # same data and initial weights on every rank
        self.train_set, self.eval_sets = self.recipe.build_datasets()
        if len(self.train_set) == 0:
            raise ValueError(f"recipe {cfg.recipe}: the training split is empty (data.path={self._data_path()})")
        self.model = self.recipe.build_model().to(self.device)
        seed_everything(rank_seed(cfg.seed, info.rank))  # per-rank dropout/sampling streams
        self.wrapped = wrap_model(self.model, info, cfg.dist, self.recipe.find_unused_parameters,
                                  self.recipe.broadcast_buffers)
        self.sync_timer = syncwait.attach(self.wrapped) if self.tc.measure_sync and isinstance(self.wrapped, DDP) \
            else None
        self.sampler = ResumableSampler(len(self.train_set), info.rank, info.world_size, True, cfg.seed)
        plan = self.recipe.epoch_batches(0)
        self.micro_per_epoch = len(plan) if plan is not None else math.ceil(self.sampler.per_rank / self.batch_size)
        self.steps_per_epoch = math.ceil(self.micro_per_epoch / self.accum)
        gpus = info.world_size * info.replicas      # what lr scaling counts: every GPU a batch is spread over
        self.optimizer = self.recipe.build_optimizer(self.model, scaled_lr(self.tc.lr, self.tc.lr_scaling, gpus)) \
            or build_optimizer(self.model.parameters(), self.tc, gpus)
        self.scheduler = build_scheduler(self.optimizer, self.tc, self.steps_per_epoch)
        self.amp_dtype = amp_dtype(self.tc.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        log.info("recipe=%s world=%d device=%s batch/rank=%d accum=%d steps/epoch=%d params=%d",
                 cfg.recipe, info.world_size, info.device, self.batch_size, self.accum,
                 self.steps_per_epoch, sum(p.numel() for p in self.model.parameters()))

    def _data_path(self) -> str:
        return str(getattr(self.cfg.data, "path", ""))

    def autocast(self):
        """Mixed precision context for forward passes (a no-op with --amp off)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ---------------------------------------------------------------- checkpoints
    def _snapshot(self, kind: str) -> dict[str, Any]:
        rngs = runtime.all_gather_object(ckpt_io.capture_rng(), self.info)
        return dict(recipe=self.cfg.recipe, kind=kind, model=self.model.state_dict(),
                    optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
                    scaler=self.scaler.state_dict(), state=asdict(self.state), world_size=self.info.world_size,
                    global_step=self.state.global_step, rng=rngs, config=to_dict(self.cfg),
                    metrics=self.last_metrics, versions=ckpt_io.versions())

    def save(self, kind: str) -> None:
        """Every rank contributes its RNG state; rank 0 writes atomically."""
        snap = self._snapshot(kind)
        if self.info.is_main:
            path = self.ckpts.save(snap, kind)
            log.info("saved %s checkpoint %s (epoch %d, step %d)", kind, path, self.state.epoch,
                     self.state.global_step)
        runtime.barrier(self.info)

    def resume(self) -> None:
        """Restore from --resume PATH or the newest valid checkpoint of the run directory; a run that starts
        fresh takes its initial weights from --init-from (weights only) when given."""
        if not self._restore() and self.cfg.ckpt.init_from:
            self._init_from(self.cfg.ckpt.init_from)

    def _init_from(self, path: str) -> None:
        """Weights of another run's checkpoint; optimizer, schedule, step and RNG start fresh."""
        ckpt = ckpt_io.load(path)
        ckpt_io.check_compatible(ckpt, self.cfg.recipe, self.model, path)
        self.model.load_state_dict(ckpt["model"])
        log.info("initial weights from %s (step %d of that run); optimizer, schedule and step start fresh",
                 path, ckpt["global_step"])

    def _restore(self) -> bool:
        spec = self.cfg.ckpt.resume
        if not spec:
            return False
        path = spec
        if spec == "auto":
            found = self.ckpts.newest_valid() if self.info.is_main else None
            path = runtime.broadcast_object(str(found[0]) if found else None, self.info)
            if path is None:
                log.info("--resume auto: no checkpoint in %s, starting fresh", self.ckpts.dir)
                return False
        ckpt = ckpt_io.load(path)
        ckpt_io.check_compatible(ckpt, self.cfg.recipe, self.model, path)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.state = TrainState(**ckpt["state"])
        self.last_metrics = ckpt.get("metrics", {})
        if ckpt["world_size"] == self.info.world_size:
            ckpt_io.restore_rng(ckpt["rng"][self.info.rank])
        else:
            log.warning("checkpoint written by %d ranks, resuming with %d: restarting epoch %d from its "
                        "first sample", ckpt["world_size"], self.info.world_size, self.state.epoch)
            self.state.batch_in_epoch = 0
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, self.state.epoch,
                 self.state.batch_in_epoch, self.state.global_step)
        if self.info.is_main:
            self.ckpts.set_aside_newer(self.state.global_step, path)
        return True

    # ---------------------------------------------------------------- training
    def _window_len(self, micro: int) -> int:
        """Micro-batches in the accumulation window holding `micro` (the last one may be short)."""
        start = micro - micro % self.accum
        return min(self.accum, self.micro_per_epoch - start)

    def _optimizer_step(self) -> None:
        if self.tc.clip_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.global_step += 1

    def _micro_step(self, batch: Any, micro: int) -> tuple[float, int]:
        """Forward/backward of one micro-batch; gradients sync only on the window's last one."""
        last = (micro + 1) % self.accum == 0 or micro + 1 == self.micro_per_epoch
        sync = contextlib.nullcontext() if last or not isinstance(self.wrapped, DDP) else self.wrapped.no_sync()
        batch = move_to(batch, self.device)
        with sync:
            with self.autocast():
                loss = self.recipe.training_step(self.wrapped, batch)
            self.scaler.scale(loss / self._window_len(micro)).backward()
        if self.sync_timer is not None:
            self.meter.update(0, synced=self.sync_timer.take())
        n = self.recipe.batch_size_of(batch)
        return float(loss.detach()) * n, n

    def train_epoch(self, epoch: int, preempt: PreemptionHandler) -> int:
        """Run (the rest of) one epoch; returns the agreed signal, MAX_STEPS, or 0 when it completed."""
        start = self.state.batch_in_epoch
        loader = self._batches(epoch, start)
        self.wrapped.train()
        t0 = time.perf_counter()
        bar = self._progress(epoch, start)
        window = torch.zeros(2, dtype=torch.float64)  # loss sum, samples since the last log line
        epoch_sums = torch.zeros(2, dtype=torch.float64)
        bad_loss = False
        for micro, batch in enumerate(self.meter.timed(loader), start=start):
            loss_sum, n = self._micro_step(batch, micro)
            bad_loss = bad_loss or not math.isfinite(loss_sum)
            window += torch.tensor([loss_sum, n], dtype=torch.float64)
            epoch_sums += torch.tensor([loss_sum, n], dtype=torch.float64)
            self.meter.update(n)
            if bar is not None:
                bar.update(1)
            if (micro + 1) % self.accum and micro + 1 != self.micro_per_epoch:
                continue
            self._optimizer_step()
            self.meter.update(0, steps=1)
            self.state.batch_in_epoch = micro + 1
            if self.state.global_step % max(self.tc.log_every_steps, 1) == 0:
                self._log_train(epoch, window, bar)
                window.zero_()
            stop = self._after_step(preempt, bad_loss)
            if stop:
                self._close_bar(bar)
                return stop
        self._close_bar(bar)
        self._log_epoch(epoch, epoch_sums, time.perf_counter() - t0)
        return 0

    def _batches(self, epoch: int, start: int):
        """This rank's batches of the epoch from micro-batch `start` on: the recipe's plan or the sampler's."""
        plan = self.recipe.epoch_batches(epoch)
        if plan is not None:
            return (plan[i] for i in range(start, len(plan)))
        self.sampler.set_epoch(epoch, start * self.batch_size)
        return make_loader(self.train_set, self.sampler, self.batch_size, self.tc.num_workers,
                           self.recipe.collate_fn(), rank_seed(self.cfg.seed, self.info.rank, epoch),
                           pin_memory=self.device.type == "cuda")

    def _after_step(self, preempt: PreemptionHandler, bad_loss: bool = False) -> int:
        signum, bad = self._timed_sync(preempt.agreed_signal, self.info, bad_loss)
        if bad:
            self._stop_on_bad_loss()
        if signum:
            return signum
        every = self.cfg.ckpt.every_steps
        end_of_epoch = self.state.batch_in_epoch == self.micro_per_epoch  # end_epoch() decides then
        if every > 0 and self.state.global_step % every == 0 and not end_of_epoch:
            self.save("periodic")
        if 0 < self.tc.max_steps <= self.state.global_step:
            return MAX_STEPS
        return 0

    def _stop_on_bad_loss(self) -> None:
        """A NaN/inf loss on any rank: stop before anything else is written; the checkpoints on disk were
        all written before it, so the last good one stays the newest."""
        if self.info.is_main:
            newest = self.ckpts.candidates()[:1]
            last = f"the last good checkpoint is {newest[0]}" if newest else "no checkpoint was written yet"
        else:
            last = "rank 0 names the last good checkpoint"
        raise NonFiniteLossError(
            f"non-finite loss at step {self.state.global_step} (epoch {self.state.epoch}, batch "
            f"{self.state.batch_in_epoch}); training stopped, {last}.\nHINT: lower --lr, set train.clip_grad_norm, "
            f"use --amp bf16 instead of fp16, check the data for NaN/inf; continue with --resume auto.")

    # ---------------------------------------------------------------- logging
    def _progress(self, epoch: int, start: int):
        mode = self.tc.progress
        if not self.info.is_main or mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
            return None
        return progress_bar(total=self.micro_per_epoch, initial=start, desc=f"epoch {epoch}", unit="batch",
                            dynamic_ncols=True, leave=False)

    @staticmethod
    def _close_bar(bar) -> None:
        if bar is not None:
            bar.close()

    def _timed_sync(self, collective, *args):
        """A per-step collective; with train.measure_sync its time counts as waiting for the other ranks."""
        if self.sync_timer is None:
            return collective(*args)
        t0 = time.perf_counter()
        out = collective(*args)
        self.meter.update(0, synced=time.perf_counter() - t0)
        return out

    def _reduced(self, sums: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) a small float64 statistics vector across ranks."""
        t = sums.clone().to(runtime.comm_device(self.info))
        return runtime.all_reduce(t, self.info).cpu()

    def _log_train(self, epoch: int, window: torch.Tensor, bar) -> None:
        loss_sum, count = self._timed_sync(self._reduced, window).tolist()
        rates = self.meter.rates()
        rates["samples_per_s"] *= self.info.world_size  # every rank runs at the same pace
        self.meter.reset()
        metrics = dict(loss=loss_sum / max(count, 1), lr=self.scheduler.get_last_lr()[0], **rates,
                       **self.stats.snapshot(self.device))
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
        log.info("epoch %d step %d loss %.5f lr %.3e %.1f samples/s", epoch, self.state.global_step,
                 metrics["loss"], metrics["lr"], metrics["samples_per_s"])
        self.writer.write("train", epoch, self.state.global_step, metrics)

    def _log_epoch(self, epoch: int, sums: torch.Tensor, seconds: float) -> None:
        loss_sum, count = self._reduced(sums).tolist()
        if count:
            self.writer.write("train", epoch, self.state.global_step,
                              dict(epoch_loss=loss_sum / count, epoch_time_s=round(seconds, 4)))

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, split: str) -> dict[str, Any]:
        """Metrics of one evaluation split, computed sharded across ranks."""
        model = self.wrapped if isinstance(self.wrapped, torch.nn.DataParallel) else self.model
        metrics = evaluate(self.recipe, model, self.eval_sets[split], self.info,
                           self.tc.eval_batch_size or self.batch_size, self.tc.num_workers, self.autocast)
        self.last_metrics[split] = metrics
        return metrics

    def evaluate_and_log(self, split: str, epoch: int, **tags: Any) -> dict[str, Any]:
        """evaluate() plus metrics.jsonl/TensorBoard/console on rank 0 (epoch: the one just trained)."""
        t0 = time.perf_counter()
        metrics = self.evaluate(split)
        self.last_records[split] = dict(metrics, eval_time_s=round(time.perf_counter() - t0, 4), **tags)
        self.writer.write(split, epoch, self.state.global_step, self.last_records[split])
        if self.info.is_main:
            shown = {k: round(v, 5) for k, v in metrics.items() if isinstance(v, float) and "/" not in k}
            log.info("%s after epoch %d: %s", split, epoch, shown)
            self.recipe.after_evaluation(split, metrics, str(self.run_dir), epoch)
        return metrics


class Driver:
    """Epochs, evaluation, best/periodic/final checkpoints, early stopping and preemption."""

    def __init__(self, loop: Loop):
        self.loop, self.cfg, self.info = loop, loop.cfg, loop.info
        self.metric, self.mode = loop.recipe.primary_metric

    def run(self, preempt: PreemptionHandler) -> FitResult:
        loop, state = self.loop, self.loop.state
        status = "completed"
        while state.epoch < self.cfg.train.epochs:
            epoch = state.epoch
            loop.recipe.on_epoch_start(epoch, loop.model)
            stop = loop.train_epoch(epoch, preempt)
            if stop > 0:
                return self.preempted(stop)
            if stop == MAX_STEPS and state.batch_in_epoch < loop.micro_per_epoch:
                break
            if self.end_epoch(epoch):
                status = "early_stopped"
                break
            if stop == MAX_STEPS:
                break
        return self.finish(status)

    def end_epoch(self, epoch: int) -> bool:
        """Evaluate, track the best, checkpoint; True when early stopping triggers."""
        loop, state, tc = self.loop, self.loop.state, self.cfg.train
        loop.recipe.on_epoch_end(epoch, loop.model)
        extra = loop.recipe.epoch_metrics()
        if extra:
            loop.writer.write("train", epoch, state.global_step, extra)
        state.epoch, state.batch_in_epoch = epoch + 1, 0
        last = state.epoch >= tc.epochs
        if "val" in loop.eval_sets and (state.epoch % max(tc.eval_every_epochs, 1) == 0 or last):
            metrics = loop.evaluate_and_log("val", epoch)
            if self.improved(metrics):
                state.best, state.bad_epochs = float(metrics[self.metric]), 0
                tie = loop.recipe.tie_break_metric
                state.best_tie = float(metrics[tie[0]]) if tie and tie[0] in metrics else None
                if self.cfg.ckpt.save_best:
                    loop.save("best")
            else:
                state.bad_epochs += 1
        ck = self.cfg.ckpt
        due = (ck.every_epochs > 0 and state.epoch % ck.every_epochs == 0) or \
            (ck.every_steps > 0 and state.global_step % ck.every_steps == 0)
        if due and not last:  # the final checkpoint follows the last epoch
            loop.save("periodic")
        patience = tc.early_stop_patience
        if patience > 0 and state.bad_epochs >= patience:
            log.info("early stopping: %s did not improve for %d evaluations", self.metric, patience)
            return True
        return False

    def improved(self, metrics: dict[str, Any]) -> bool:
        """True when the primary metric beats the best so far."""
        if self.metric not in metrics:
            raise KeyError(f"recipe {self.cfg.recipe}: primary metric {self.metric!r} not among the "
                           f"validation metrics {sorted(metrics)}")
        value, best = float(metrics[self.metric]), self.loop.state.best
        if best is None:
            return True
        if value != best:
            return better(value, best, self.mode)
        tie, best_tie = self.loop.recipe.tie_break_metric, self.loop.state.best_tie
        return bool(tie) and tie[0] in metrics and best_tie is not None and \
            better(float(metrics[tie[0]]), best_tie, tie[1])

    def preempted(self, signum: int) -> FitResult:
        """Checkpoint where we are; rank 0 requeues under Slurm for the requeue signals."""
        import signal as _signal
        loop = self.loop
        name = _signal.Signals(signum).name
        log.warning("received %s: checkpointing at epoch %d step %d", name, loop.state.epoch,
                    loop.state.global_step)
        loop.save("periodic")
        if self.info.is_main:     # tells slurm/common.sh this 143 is a checkpointed stop, not a crash
            marker = f"{name} epoch {loop.state.epoch} step {loop.state.global_step}\n"
            (loop.run_dir / PREEMPTED_MARKER).write_text(marker)
        requeued = False
        # srun tasks and torchrun inside an allocation requeue here; submitit requeues via checkpoint()
        if self.info.is_main and name in self.cfg.ckpt.requeue_signals and self.info.can_requeue \
                and self.info.requeue_id:
            from trainer.engine.preemption import requeue_slurm_job
            requeued = requeue_slurm_job(self.info.requeue_id)
        requeued = bool(runtime.broadcast_object(requeued, self.info))
        return FitResult("preempted", signum, requeued, loop.state.global_step, loop.last_metrics)

    def finish(self, status: str) -> FitResult:
        """Final checkpoint, then the test split with the final and (if any) the best weights."""
        loop = self.loop
        loop.save("final")
        epoch = max(loop.state.epoch - 1, 0)
        if "test" in loop.eval_sets:
            loop.evaluate_and_log("test", epoch, checkpoint="final")
            best = loop.ckpts.dir / "best.pt"
            if self.cfg.ckpt.save_best and best.exists():
                ckpt = ckpt_io.load(best)
                if ckpt["global_step"] == loop.state.global_step:   # the final weights are the best
                    metrics = dict(loop.last_metrics["test"])
                    loop.writer.write("test", epoch, loop.state.global_step,
                                      dict(loop.last_records["test"], checkpoint="best"))
                else:
                    loop.model.load_state_dict(ckpt["model"])
                    metrics = loop.evaluate_and_log("test", epoch, checkpoint="best")
                loop.last_metrics["test_best"] = metrics
        log.info("training %s after %d steps", status, loop.state.global_step)
        return FitResult(status, 0, False, loop.state.global_step, loop.last_metrics)


def fit(recipe: Recipe, info: DistInfo, cfg: Config) -> FitResult:
    """Train recipe under the given process layout; checkpoints and logs go to cfg.run_dir."""
    if info.restart_count:
        log.info("restart %d of job %s (launcher %s)", info.restart_count, info.job_id, info.launcher)
    loop = Loop(recipe, info, cfg)
    if info.is_main:
        (loop.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
    loop.resume()
    preempt = PreemptionHandler().install()
    try:
        return Driver(loop).run(preempt)
    finally:
        preempt.restore()
        loop.writer.close()

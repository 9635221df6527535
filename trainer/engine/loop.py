"""The training loop: one code path for single process, DataParallel and DDP.

    result = fit(recipe, dist_info, cfg)   # cfg: trainer.config.settings.Config; see trainer/__main__.py

EpochLoop runs the steps of an epoch and says why it stopped (Stop); FitLoop runs the epochs: evaluation,
best/periodic/final checkpoints, early stopping and preemption. Building the run is trainer/engine/build.py,
checkpoints trainer/engine/checkpointer.py, evaluation trainer/engine/evaluation.py.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import math
import signal as signals
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config.settings import Config
from trainer.distributed import preflight, runtime
from trainer.distributed.runtime import DistInfo
from trainer.distributed.stragglers import Straggler
from trainer.engine import ckpt_io
from trainer.engine.build import Run, build_run, rank_seed
from trainer.engine.checkpointer import Checkpointer
from trainer.engine.evaluation import evaluate_split
from trainer.engine.loader import device_batches, make_loader
from trainer.engine.logging import MetricsWriter
from trainer.engine.meters import SystemStats, Throughput
from trainer.engine.preemption import (
    FORWARD_HINT,
    PreemptionHandler,
    ShutdownBudget,
    requeue_slurm_job,
    trapped_signals,
    unforwarded_signals,
)
from trainer.engine.profile import StepProfiler
from trainer.engine.recipe import Recipe, move_to
from trainer.engine.resume import Planned, write_resume_record
from trainer.engine.state import TrainState
from trainer.engine.window import LossWindow, NonFiniteLossError, Reading, WindowExchange
from trainer.launch.exitcodes import PREEMPTED_MARKER, StragglerError, UnfitHostError
from trainer.native.console import progress_bar

__all__ = ["fit", "FitResult", "NonFiniteLossError", "Stop", "EpochLoop", "FitLoop"]

log = logging.getLogger(__name__)


class Stop(enum.Enum):
    """Why EpochLoop.train_epoch returned."""

    EPOCH_DONE = "epoch done"
    SIGNAL = "signal"             # an agreed preemption signal (EpochLoop.signal names it)
    MAX_STEPS = "max steps"       # train.max_steps reached
    EVICT = "evict"               # a straggler named under train.straggler_action=evict (its exchange.evicted)


@dataclass
class FitResult:
    """What fit() reports to its caller."""

    status: str                   # completed | preempted | early_stopped
    signal: int = 0
    requeued: bool = False
    global_step: int = 0
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)


def better(value: float, than: float, mode: str) -> bool:
    """value beats than under mode 'min' or 'max'."""
    return value < than if mode == "min" else value > than


def non_finite(reading: Reading, step: int, last_good: str) -> NonFiniteLossError:
    """The error for a read window with a NaN/inf loss on any rank: nothing is written after it, and every
    checkpoint on disk was written before the read, so the last good one stays the newest."""
    bad = reading.bad
    return NonFiniteLossError(
        f"non-finite loss at step {bad.step} (epoch {bad.epoch}, batch {bad.batch}); training stopped at step "
        f"{step}, {last_good}.\nHINT: lower --lr, set train.clip_grad_norm, use --amp bf16 instead of fp16, "
        f"check the data for NaN/inf; continue with --resume auto.")


def epoch_bar(info: DistInfo, mode: str, total: int, epoch: int, start: int):
    """Rank 0's tqdm bar over an epoch's micro-batches (train.progress: auto shows it on a terminal)."""
    if not info.is_main or mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
        return None
    return progress_bar(total=total, initial=start, desc=f"epoch {epoch}", unit="batch", dynamic_ncols=True,
                        leave=False)


def close_bar(bar) -> None:
    if bar is not None:
        bar.close()


class EpochLoop:
    """The steps of an epoch: micro-batches, accumulation, optimizer steps, logging, stop checks."""

    def __init__(self, run: Run, ckpts: Checkpointer, writer: MetricsWriter, state: TrainState,
                 last_metrics: dict):
        self.run, self.ckpts, self.writer, self.state = run, ckpts, writer, state
        self.info, self.cfg, self.tc = run.info, run.cfg, run.cfg.train
        self.stats, self.meter = SystemStats(), Throughput(run.device)
        self.last_metrics: dict[str, dict[str, Any]] = last_metrics
        self.last_records: dict[str, dict[str, Any]] = {}   # as written to metrics.jsonl
        self.signal = 0
        self.budget = ShutdownBudget(run.info)     # torchrun's shutdown limit vs a step plus a checkpoint
        self.losses = LossWindow(run.device, run.info, max(self.tc.log_every_steps, 1) * run.accum)
        self.window = [0.0, 0.0]          # loss sum and samples read since the last log line (over the ranks)
        self.epoch_sums = [0.0, 0.0]      # the same since the epoch (or its resumed part) started
        self.profiler = StepProfiler(self.tc.profile, self.cfg.run_dir, self.info)   # train.profile
        self.end = run.micro_per_epoch    # the micro-batch index where the current epoch ends (see train_epoch)
        self.first = (0, 0)               # (micro-batch, sample) where this epoch's part in this process began
        state.layout = [run.info.world_size, run.batch_size, run.accum]
        self.exchange = WindowExchange(run.info, self.cfg, self.meter.cuda)  # agreement cadence, straggler watch

    def settle(self, preempt: PreemptionHandler | None = None) -> int:
        """Read the losses kept on the device (one sync); a non-finite one on any rank stops the run here (every
        checkpoint follows such a read: none holds weights a non-finite loss went into). With `preempt`, the same
        collective agrees on the signal (returned) and carries the window's figures (WindowExchange)."""
        reading = self.losses.read(self.exchange.sent(preempt) if preempt is not None else None)
        if reading.bad is not None:
            last = self.ckpts.last_good() if self.info.is_main else "rank 0 names the last good checkpoint"
            raise non_finite(reading, self.state.global_step, last)
        for sums in (self.window, self.epoch_sums):
            sums[0] += reading.loss_sum
            sums[1] += reading.samples
        if preempt is None:
            return 0
        return self.exchange.signal(preempt, reading.extra, self.state.global_step)

    def save(self, kind: str) -> None:
        self.settle()
        t0 = time.perf_counter()
        self.ckpts.save(kind, self.state, self.last_metrics)
        self.budget.saved(time.perf_counter() - t0)

    # ---------------------------------------------------------------- steps
    def _window_len(self, micro: int) -> int:
        """Micro-batches in the accumulation window holding `micro` (the last one may be short)."""
        start = micro - micro % self.run.accum
        return min(self.run.accum, self.end - start)

    def _optimizer_step(self) -> None:
        run = self.run
        if self.tc.clip_grad_norm > 0:
            run.scaler.unscale_(run.optimizer)
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), self.tc.clip_grad_norm)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        self.state.global_step += 1

    def _micro_step(self, batch: Any, micro: int) -> int:
        """Forward/backward of one micro-batch; gradients sync only on the window's last one. Its loss stays
        on the device (self.losses); returns its samples."""
        run = self.run
        last = (micro + 1) % run.accum == 0 or micro + 1 == self.end
        sync = contextlib.nullcontext() if last or not isinstance(run.wrapped, DDP) else run.wrapped.no_sync()
        batch = move_to(batch, run.device)
        t0 = time.perf_counter()
        run.recipe.before_step(batch)
        with sync:
            with run.autocast():
                loss = run.train_step(batch)
            run.recipe.after_step()
            t1 = time.perf_counter()
            run.scaler.scale(loss / self._window_len(micro)).backward()
            if last and run.grad_sync is not None:
                run.grad_sync()
        if self.tc.measure_sync:        # where a DDP step's time beyond one rank's goes (bench/run.py)
            self.meter.update(0, phases={"forward": t1 - t0, "backward": time.perf_counter() - t1})
        if run.sync_timer is not None:
            self.meter.update(0, synced=self.exchange.waited(run.sync_timer.take()))
        n = run.recipe.batch_size_of(batch)
        if self.losses.full:            # train.log_every_steps beyond the buffer: read it now
            self.settle()
        self.losses.add(loss, n, self.state.global_step + 1, self.state.epoch, micro + 1)
        return n

    def step(self, batch: Any, micro: int) -> bool:
        """One micro-batch, and the optimizer step when it ends an accumulation window (then True). Nothing
        here reads a device value: the path a CUDA step takes queues its kernels without waiting."""
        self.meter.update(self._micro_step(batch, micro))
        if (micro + 1) % self.run.accum and micro + 1 != self.end:
            return False
        self._optimizer_step()
        self.profiler.at(self.state.global_step)
        return True

    def train_epoch(self, epoch: int, preempt: PreemptionHandler) -> Stop:
        """Run (the rest of) one epoch."""
        start, run = self.state.batch_in_epoch, self.run
        loader = self.batches(epoch, start)
        run.wrapped.train()
        t0 = t_step = time.perf_counter()
        bar = epoch_bar(self.info, self.tc.progress, self.end, epoch, start)
        self.epoch_sums = [0.0, 0.0]
        self.profiler.at(self.state.global_step)
        for micro, batch in enumerate(self.meter.timed(loader), start=start):
            stepped = self.step(batch, micro)
            if bar is not None:
                bar.update(1)
            if not stepped:
                continue
            self.budget.step(self.exchange.stepped(time.perf_counter() - t_step))
            self.meter.update(0, steps=1)
            self._advance(micro + 1)
            if self.state.global_step % max(self.tc.log_every_steps, 1) == 0:
                signum = self._timed_sync(self.settle, preempt)    # the window's read agrees on the signal too
                self._log_train(epoch, bar)
            else:       # between windows, every few steps (ckpt.signal_latency_s)
                turn = self.exchange.cadence.turn(self.state.global_step)
                signum = self._timed_sync(preempt.agreed_signal, self.info) if turn else 0
            stop = self._after_step(signum)
            if stop is Stop.EPOCH_DONE and self.exchange.evicting():
                stop = Stop.EVICT
            if stop is not Stop.EPOCH_DONE:
                close_bar(bar)
                return stop
            t_step = time.perf_counter()    # a periodic checkpoint in _after_step is not part of a step
        close_bar(bar)
        self.settle()
        loss_sum, count = self.epoch_sums
        if count:
            self.writer.write("train", epoch, self.state.global_step,
                              dict(epoch_loss=loss_sum / count, epoch_time_s=round(time.perf_counter() - t0, 4)))
        return Stop.EPOCH_DONE

    def _advance(self, micro: int) -> None:
        """`micro` micro-batches of the epoch done: so many of this rank, and (over all ranks) so many samples of
        the epoch's permutation, where a resume goes on, in whatever layout it comes back."""
        state, (first, sample), run = self.state, self.first, self.run
        state.batch_in_epoch, state.batches_in_epoch = micro, self.end
        if run.sampler is not None:
            done = (micro - first) * run.batch_size * self.info.world_size
            state.sample_in_epoch = min(sample + done, run.sampler.size)

    def batches(self, epoch: int, start: int):
        """This rank's batches of the epoch from micro-batch `start` (sample `state.sample_in_epoch`) on: the
        recipe's plan or the sampler's. Sets where the epoch ends (self.end)."""
        run = self.run
        plan = run.recipe.epoch_batches(epoch)
        if plan is not None:
            self.end = len(plan)
            return (plan[i] for i in range(start, len(plan)))
        self.first = (start, self.state.sample_in_epoch)
        run.sampler.set_epoch(epoch, self.state.sample_in_epoch)
        self.end = start + math.ceil(run.sampler.per_rank / run.batch_size)
        if run.device_data is not None:
            return device_batches(run.device_data, run.sampler, run.batch_size, epoch, run.device)
        return make_loader(run.train_set, run.sampler, run.batch_size, self.tc.num_workers,
                           run.recipe.collate_fn(), rank_seed(self.cfg.seed, self.info.rank, epoch),
                           pin_memory=run.device.type == "cuda")

    def _after_step(self, signum: int) -> Stop:
        """Act on the step's agreement (a signal), then periodic work."""
        if signum:
            self.settle()                # a non-finite loss before the signal stops the run instead
            self.signal = signum
            return Stop.SIGNAL
        every = self.cfg.ckpt.every_steps
        end_of_epoch = self.state.batch_in_epoch == self.end  # end_epoch() decides then
        if every > 0 and self.state.global_step % every == 0 and not end_of_epoch:
            self.save("periodic")
        # max_steps counts steps of the schedule: a resume in another layout converted it (resume.continue_at)
        if 0 < self.tc.max_steps <= self.run.scheduler.last_epoch:
            return Stop.MAX_STEPS         # (the final checkpoint's save reads the losses first)
        return Stop.EPOCH_DONE

    # ---------------------------------------------------------------- logging
    def _timed_sync(self, collective, *args):
        """A per-step collective; with train.measure_sync its time counts as waiting for the other ranks."""
        if self.run.sync_timer is None:
            return collective(*args)
        t0 = time.perf_counter()
        out = collective(*args)
        self.meter.update(0, synced=time.perf_counter() - t0)
        return out

    def _log_train(self, epoch: int, bar) -> None:
        """One train record: the window's losses, read by the caller's settle() (a window's one host sync)."""
        loss_sum, count = self.window
        self.window = [0.0, 0.0]
        rates = self.exchange.logged(self.meter.rates(), self.meter.steps, self.tc.measure_sync)
        rates["samples_per_s"] *= self.info.world_size  # every rank runs at the same pace
        self.meter.reset()
        metrics = dict(loss=loss_sum / max(count, 1), lr=self.run.scheduler.get_last_lr()[0], **rates,
                       **self.stats.snapshot(self.run.device), **self.exchange.take_fields())
        if bar is not None:
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
        log.info("epoch %d step %d loss %.5f lr %.3e %.1f samples/s", epoch, self.state.global_step,
                 metrics["loss"], metrics["lr"], metrics["samples_per_s"])
        self.writer.write("train", epoch, self.state.global_step, metrics)


def evaluate_and_log(epoch_loop: EpochLoop, split: str, epoch: int, **tags: Any) -> dict[str, Any]:
    """Evaluate a split, then metrics.jsonl/TensorBoard/console on rank 0 (epoch: the one just trained)."""
    t0 = time.perf_counter()
    if epoch_loop.run.recipe.buffers_before_eval and isinstance(epoch_loop.run.wrapped, DDP):
        for buf in epoch_loop.run.model.buffers():
            runtime.broadcast(buf, epoch_loop.info)
    metrics = epoch_loop.last_metrics[split] = evaluate_split(epoch_loop.run, split)
    epoch_loop.last_records[split] = dict(metrics, eval_time_s=round(time.perf_counter() - t0, 4), **tags)
    epoch_loop.writer.write(split, epoch, epoch_loop.state.global_step, epoch_loop.last_records[split])
    if epoch_loop.info.is_main:
        shown = {k: round(v, 5) for k, v in metrics.items() if isinstance(v, float) and "/" not in k}
        which = f" ({tags['checkpoint']} checkpoint)" if "checkpoint" in tags else ""
        log.info("%s%s after epoch %d: %s", split, which, epoch, shown)
        for png in epoch_loop.run.recipe.after_evaluation(split, metrics, str(epoch_loop.cfg.run_dir), epoch) or ():
            epoch_loop.writer.image(f"{split}/{Path(png).stem}", png, epoch_loop.state.global_step)
    return metrics


class FitLoop:
    """Epochs, evaluation, best/periodic/final checkpoints, early stopping and preemption."""

    def __init__(self, epoch_loop: EpochLoop):
        self.epoch_loop, self.cfg, self.info = epoch_loop, epoch_loop.cfg, epoch_loop.info
        self.run_dir = Path(self.cfg.run_dir)
        self.metric, self.mode = epoch_loop.run.recipe.primary_metric

    @property
    def state(self) -> TrainState:
        return self.epoch_loop.state

    def run(self, preempt: PreemptionHandler) -> FitResult:
        epoch_loop, state, recipe = self.epoch_loop, self.epoch_loop.state, self.epoch_loop.run.recipe
        status = "completed"
        if state.epoch >= self.cfg.train.epochs:       # --epochs 0, or a resume of a run already done
            log.warning("no training ran: the run is at epoch %d and --epochs is %d (step %d); the final "
                        "checkpoint and test below are of %s", state.epoch, self.cfg.train.epochs, state.global_step,
                        "the resumed weights" if state.global_step else "untrained weights")
        while state.epoch < self.cfg.train.epochs:
            epoch = state.epoch
            recipe.on_epoch_start(epoch, epoch_loop.run.model)
            stop = epoch_loop.train_epoch(epoch, preempt)
            if stop is Stop.SIGNAL:
                return self.preempted(epoch_loop.signal, preempt.received_at)
            if stop is Stop.EVICT:
                self.evict(epoch_loop.exchange.evicted)
            if stop is Stop.MAX_STEPS and state.batch_in_epoch < epoch_loop.end:
                break
            if self.end_epoch(epoch):
                status = "early_stopped"
                break
            if stop is Stop.MAX_STEPS:
                break
        return self.finish(status)

    def end_epoch(self, epoch: int) -> bool:
        """Evaluate, track the best, checkpoint; True when early stopping triggers."""
        epoch_loop, state, tc, recipe = self.epoch_loop, self.state, self.cfg.train, self.epoch_loop.run.recipe
        recipe.on_epoch_end(epoch, epoch_loop.run.model)
        extra = recipe.epoch_metrics()
        if extra:
            epoch_loop.writer.write("train", epoch, state.global_step, extra)
        state.epoch, state.batch_in_epoch, state.sample_in_epoch = epoch + 1, 0, 0
        last = state.epoch >= tc.epochs
        if "val" in epoch_loop.run.eval_sets and (state.epoch % max(tc.eval_every_epochs, 1) == 0 or last):
            self._track_best(evaluate_and_log(epoch_loop, "val", epoch))
        ck = self.cfg.ckpt
        due = (ck.every_epochs > 0 and state.epoch % ck.every_epochs == 0) or \
            (ck.every_steps > 0 and state.global_step % ck.every_steps == 0)
        if due and not last:  # the final checkpoint follows the last epoch
            epoch_loop.save("periodic")
        patience = tc.early_stop_patience
        if patience > 0 and state.bad_epochs >= patience:
            log.info("early stopping: %s did not improve for %d evaluations", self.metric, patience)
            return True
        return False

    def _track_best(self, metrics: dict[str, Any]) -> None:
        state = self.state
        if not self.improved(metrics):
            state.bad_epochs += 1
            return
        state.best, state.bad_epochs = float(metrics[self.metric]), 0
        tie = self.epoch_loop.run.recipe.tie_break_metric
        state.best_tie = float(metrics[tie[0]]) if tie and tie[0] in metrics else None
        if self.cfg.ckpt.save_best:
            self.epoch_loop.save("best")

    def improved(self, metrics: dict[str, Any]) -> bool:
        """True when the primary metric beats the best so far."""
        if self.metric not in metrics:
            raise KeyError(f"recipe {self.cfg.recipe}: primary metric {self.metric!r} not among the "
                           f"validation metrics {sorted(metrics)}")
        value, best = float(metrics[self.metric]), self.state.best
        if best is None:
            return True
        if value != best:
            return better(value, best, self.mode)
        tie, best_tie = self.epoch_loop.run.recipe.tie_break_metric, self.state.best_tie
        return bool(tie) and tie[0] in metrics and best_tie is not None and \
            better(float(metrics[tie[0]]), best_tie, tie[1])

    def preempted(self, signum: int, received_at: float | None = None) -> FitResult:
        """Checkpoint where we are; rank 0 requeues under Slurm for the requeue signals."""
        epoch_loop, state = self.epoch_loop, self.state
        name = signals.Signals(signum).name
        waited = f" ({time.monotonic() - received_at:.2f} s after it reached this rank)" if received_at else ""
        log.warning("received %s: checkpointing at epoch %d step %d%s", name, state.epoch, state.global_step, waited)
        epoch_loop.save("periodic")
        if received_at is not None and self.info.agent_shutdown_s is not None:
            log.info("checkpoint written %.1f s after %s reached this rank (torchrun kills its workers %.0f s "
                     "after forwarding a signal)", time.monotonic() - received_at, name, self.info.agent_shutdown_s)
        if self.info.is_main:     # tells slurm/common.sh this 143 is a checkpointed stop, not a crash
            (self.run_dir / PREEMPTED_MARKER).write_text(f"{name} epoch {state.epoch} step {state.global_step}\n")
        requeued = False
        # srun tasks and torchrun inside an allocation requeue here; submitit requeues via checkpoint()
        requeue_signal = name in self.cfg.ckpt.requeue_signals or name == self.info.preempt_signal
        if self.info.is_main and requeue_signal and self.info.can_requeue \
                and self.info.requeue_id:
            requeued = requeue_slurm_job(self.info.requeue_id)
        requeued = bool(runtime.broadcast_object(requeued, self.info))
        return FitResult("preempted", signum, requeued, state.global_step, epoch_loop.last_metrics)

    def evict(self, straggler: Straggler) -> None:
        """train.straggler_action=evict: an agreed checkpoint (every rank named the same straggler from the same
        window), then StragglerError: exit 5, which the restart loop reads as "relaunch without this host"."""
        self.epoch_loop.save("periodic")
        log.warning("straggler evicted: checkpoint of step %d written; exit 5 (unfit host %s)",
                    self.state.global_step, straggler.host)
        raise StragglerError(straggler.host, straggler.describe())

    def finish(self, status: str) -> FitResult:
        """Final checkpoint, then the test split with the final and (if any) the best weights."""
        epoch_loop, state = self.epoch_loop, self.state
        epoch_loop.save("final")
        epoch = max(state.epoch - 1, 0)
        if "test" in epoch_loop.run.eval_sets:
            evaluate_and_log(epoch_loop, "test", epoch, checkpoint="final")
            best = epoch_loop.ckpts.dir / "best.pt"
            if self.cfg.ckpt.save_best and best.exists():
                epoch_loop.last_metrics["test_best"] = self._test_best(best, epoch)
        log.info("training %s after %d steps", status, state.global_step)
        if self.info.is_main:
            self.where_it_is()
        return FitResult(status, 0, False, state.global_step, epoch_loop.last_metrics)

    def where_it_is(self) -> None:
        """The run's last lines: its directory, checkpoint files and the TensorBoard command."""
        ckpts = sorted(p.name for p in self.epoch_loop.ckpts.dir.glob("*.pt"))
        log.info("run directory: %s", self.run_dir)
        log.info("checkpoints: %s (in %s)", ", ".join(ckpts) or "none", self.epoch_loop.ckpts.dir)
        if self.cfg.train.tensorboard:
            log.info("TensorBoard: tensorboard --logdir %s", self.run_dir / "tb")

    def _test_best(self, best: Path, epoch: int) -> dict[str, Any]:
        epoch_loop = self.epoch_loop
        ckpt = ckpt_io.load(best)
        if ckpt["global_step"] == self.state.global_step:   # the final weights are the best
            log.info("test (best checkpoint): the final checkpoint (step %d), the same metrics", ckpt["global_step"])
            epoch_loop.writer.write("test", epoch, self.state.global_step,
                                 dict(epoch_loop.last_records["test"], checkpoint="best"))
            return dict(epoch_loop.last_metrics["test"])
        epoch_loop.run.model.load_state_dict(ckpt["model"])
        return evaluate_and_log(epoch_loop, "test", epoch, checkpoint="best")


def check_hosts(run: Run, run_dir: Path) -> None:
    """The pre-flight (trainer/distributed/preflight.py): RUN_DIR/preflight.json and a summary line; unfit hosts
    stop the run (UnfitHostError, exit 5), which the restart loop relaunches without them."""
    need = run.footprint.total if run.footprint is not None else 0
    verdict = preflight.run_checks(run.info, need, run.amp_dtype or torch.float32)
    if run.info.is_main:
        preflight.write_report(run_dir, verdict)
        (log.warning if verdict.unfit else log.info)("%s", verdict.summary())
    if verdict.unfit:
        raise UnfitHostError(verdict.unfit)


def fit(recipe: Recipe, info: DistInfo, cfg: Config, planned: Planned | None = None,
        commit: Callable[[], None] | None = None) -> FitResult:
    """Train recipe under the given process layout; checkpoints and logs go to cfg.run_dir. planned: what
    trainer.engine.resume.check_resume_config found (the settings a resume changes, recorded in metrics.jsonl, and
    the checkpoint to load); None: the Checkpointer looks for it itself. commit: the run directory's first
    writes (run_train's), called once the data, the model and the checkpoint passed every check."""
    if info.restart_count:
        log.info("restart %d of job %s (launcher %s)", info.restart_count, info.job_id, info.launcher)
    run_dir = Path(cfg.run_dir)
    writer = None
    try:
        run = build_run(recipe, info, cfg)
        ckpts = Checkpointer(run, run_dir, planned)
        resumed = ckpts.resume()            # the last check that can refuse the run: nothing written before it
        if commit is not None:
            commit()
        ckpts.write_id_maps()
        if info.is_main:
            (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        if preflight.wanted(cfg.train.preflight, info):
            check_hosts(run, run_dir)
        state, metrics = resumed or (TrainState(), {})
        # a resumed run logs again from the step after its checkpoint: TensorBoard drops what an earlier
        # attempt logged from there on (a crash after the checkpoint leaves such steps behind)
        writer = MetricsWriter(run_dir, info, cfg.train.tensorboard,
                               purge_step=state.global_step + 1 if resumed else None)
        if resumed:
            write_resume_record(writer, state, list(planned.changes) if planned else [], ckpts.notes)
        epoch_loop = EpochLoop(run, ckpts, writer, state, metrics)
        trapped = trapped_signals(cfg.ckpt.requeue_signals, info.preempt_signal)
        lost = unforwarded_signals(info, trapped)
        if lost and info.is_main:
            log.warning("torchrun forwards only %s to its workers: %s (trapped here for a requeue) would end its "
                        "agent, and this job step with it, before the checkpoint.\nHINT: %s",
                        ",".join(info.agent_signals or ()), ",".join(lost), FORWARD_HINT)
        preempt = PreemptionHandler(trapped).install()
        try:
            return FitLoop(epoch_loop).run(preempt)
        finally:
            preempt.restore()
            epoch_loop.profiler.close()
    finally:
        if writer is not None:
            writer.close()

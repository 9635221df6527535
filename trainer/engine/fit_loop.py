"""The fit loop: the epochs of a run. It creates and owns its epoch loop (trainer/engine/loop.py) and asks the
run's owner (trainer/engine/trainer.py) for the rest: evaluation, checkpoints, the components. A component's Stop
ends the epoch's steps; one with an exit code is checkpointed and ends the run its own way (callbacks.Stop).

    result = FitLoop(trainer).run()      # FitResult: completed | early_stopped | preempted | stopped
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol, Sequence

from trainer.config.settings import Config, ConfigError
from trainer.distributed.runtime import DistInfo
from trainer.engine.build import Run
from trainer.engine.callbacks import Component, Stop
from trainer.engine.checkpointer import Checkpointer
from trainer.engine.evaluation import Evaluations
from trainer.engine.logging import MetricsWriter
from trainer.engine.loop import EpochLoop
from trainer.engine.meters import Throughput
from trainer.engine.result import FitResult
from trainer.engine.state import TrainState
from trainer.engine.window import TrainLosses

__all__ = ["FitLoop", "FitResult", "refuse_unknown_metric", "selected_metric"]

log = logging.getLogger(__name__)


class RunOwner(Protocol):
    """What the fit loop takes from the run's owner (trainer/engine/trainer.py Trainer), which builds it."""

    cfg: Config
    info: DistInfo
    run: Run
    state: TrainState
    meter: Throughput
    losses: TrainLosses
    components: Sequence[Component]
    writer: MetricsWriter
    evaluations: Evaluations
    ckpts: Checkpointer

    def save(self, kind: str) -> None: ...


def selected_metric(setting: str, recipe: tuple[str, str]) -> tuple[str, str]:
    """(metric, mode) of train.select_metric: "" the recipe's; NAME (max, or min for a loss); NAME:max|min."""
    if not setting.strip():
        return recipe
    name, _, mode = setting.strip().partition(":")
    if mode and mode not in ("max", "min"):
        raise ConfigError(f"train.select_metric={setting!r}: the mode after ':' is max or min")
    if name == recipe[0] and not mode:
        return recipe
    return name, mode or ("min" if "loss" in name else "max")


def refuse_unknown_metric(recipe, cfg: Config) -> None:
    """train.select_metric checked against the metrics the recipe reports (Recipe.metric_names), before the run
    writes anything; a recipe that cannot tell before its first evaluation is checked there (FitLoop.improved)."""
    metric = selected_metric(cfg.train.select_metric, recipe.primary_metric)[0]
    names = recipe.metric_names() if cfg.train.select_metric.strip() else None
    if names is not None and metric not in names:
        raise ConfigError(unknown_metric(metric, cfg.recipe, names))


def unknown_metric(metric: str, recipe: str, names) -> str:
    return (f"train.select_metric: {metric!r} is not among the validation metrics of recipe {recipe}: "
            f"{', '.join(sorted(names))}")


def better(value: float, than: float, mode: str) -> bool:
    """value beats than under mode 'min' or 'max'."""
    return value < than if mode == "min" else value > than


class FitLoop:
    """Epochs, evaluation, best/final checkpoints, early stopping, and the stops the components ask for."""

    def __init__(self, trainer: RunOwner):
        self.trainer, self.cfg, self.info, self.state = trainer, trainer.cfg, trainer.info, trainer.state
        self.recipe = trainer.run.recipe
        self.metric, self.mode = selected_metric(self.cfg.train.select_metric, self.recipe.primary_metric)
        self._follow_selection()
        self.epoch_loop = EpochLoop(trainer.run, trainer.state, trainer.meter, trainer.losses, trainer.components)

    def run(self) -> FitResult:
        state, epochs = self.state, self.cfg.train.epochs
        status = "completed"
        if state.epoch >= epochs:       # --epochs 0, or a resume of a run already done
            log.warning("no training ran: the run is at epoch %d and --epochs is %d (step %d); the final "
                        "checkpoint and test below are of %s", state.epoch, epochs, state.global_step,
                        "the resumed weights" if state.global_step else "untrained weights")
        while state.epoch < epochs:
            epoch = state.epoch
            with self.trainer.run.phases.long("recipe.on_epoch_start"):
                self.recipe.on_epoch_start(epoch, self.trainer.run.model)
            stop = self.epoch_loop.train_epoch(epoch)
            if stop is not None and stop.ends_run:
                return self.stopped(stop)
            if stop is not None and state.batch_in_epoch < self.epoch_loop.end:
                break                   # mid-epoch: no end-of-epoch work for a part of an epoch
            if self.end_epoch(epoch):
                status = "early_stopped"
                break
            if stop is not None:
                break
        return self.finish(status)

    def stopped(self, stop: Stop) -> FitResult:
        """A component's stop with an exit code: a checkpoint of where the run is, then the stop's own end."""
        state = self.state
        log.warning("%s: checkpointing at epoch %d step %d%s", stop.reason, state.epoch, state.global_step,
                    stop.detail)
        self.trainer.save("periodic")
        result = (stop.then() if stop.then is not None else None) or \
            FitResult("stopped", code=stop.code, reason=stop.reason)
        result.global_step, result.metrics = state.global_step, self.trainer.evaluations.last_metrics
        return result

    def end_epoch(self, epoch: int) -> bool:
        """Evaluate, track the best, let the components act (periodic checkpoints); True when early stopping
        triggers."""
        state, tc = self.state, self.cfg.train
        with self.trainer.run.phases.long("recipe.on_epoch_end"):
            self.recipe.on_epoch_end(epoch, self.trainer.run.model)
            extra = self.recipe.epoch_metrics()
        if extra:
            self.trainer.writer.write("train", epoch, state.global_step, extra)
        state.epoch, state.batch_in_epoch, state.sample_in_epoch = epoch + 1, 0, 0
        last = state.epoch >= tc.epochs
        if "val" in self.trainer.run.eval_sets and (state.epoch % max(tc.eval_every_epochs, 1) == 0 or last):
            self._track_best(self.trainer.evaluations.evaluate("val", epoch))
        for component in self.trainer.components:
            component.evaluated(epoch, last)
        patience = tc.early_stop_patience
        if patience > 0 and state.bad_epochs >= patience:
            log.info("early stopping: %s did not improve for %d evaluations", self.metric, patience)
            return True
        return False

    def _follow_selection(self) -> None:
        """A resume whose train.select_metric differs from the metric of the checkpoint's best: the best so far
        and the early-stopping count start over (best.pt stays until a new best replaces it)."""
        state = self.state
        was = state.best_metric or self.recipe.primary_metric[0]
        if state.best is not None and was != self.metric:
            log.info("train.select_metric: best.pt and early stopping now follow %s (was %s, best %.5g): the best "
                     "so far starts over", self.metric, was, state.best)
            state.best, state.best_tie, state.bad_epochs = None, None, 0
        state.best_metric = self.metric

    def _track_best(self, metrics: dict[str, Any]) -> None:
        state = self.state
        if not self.improved(metrics):
            state.bad_epochs += 1
            return
        state.best, state.bad_epochs = float(metrics[self.metric]), 0
        tie = self.recipe.tie_break_metric
        state.best_tie = float(metrics[tie[0]]) if tie and tie[0] in metrics else None
        if self.cfg.ckpt.save_best:
            self.trainer.save("best")

    def improved(self, metrics: dict[str, Any]) -> bool:
        """True when the primary metric beats the best so far."""
        if self.metric not in metrics:
            raise ConfigError(unknown_metric(self.metric, self.cfg.recipe, metrics))
        value, best = float(metrics[self.metric]), self.state.best
        if best is None:
            return True
        if value != best:
            return better(value, best, self.mode)
        tie, best_tie = self.recipe.tie_break_metric, self.state.best_tie
        return bool(tie) and tie[0] in metrics and best_tie is not None and \
            better(float(metrics[tie[0]]), best_tie, tie[1])

    def finish(self, status: str) -> FitResult:
        """Final checkpoint, then the test split with the final and (if any) the best weights."""
        state, evaluations = self.state, self.trainer.evaluations
        self.trainer.save("final")
        epoch = max(state.epoch - 1, 0)
        if "test" in self.trainer.run.eval_sets:
            evaluations.evaluate("test", epoch, checkpoint="final")
            best = self.trainer.ckpts.dir / "best.pt"
            if self.cfg.ckpt.save_best and best.exists():
                evaluations.last_metrics["test_best"] = evaluations.test_best(best, epoch)
        log.info("training %s after %d steps", status, state.global_step)
        if self.info.is_main:
            self.where_it_is()
        return FitResult(status, 0, False, state.global_step, evaluations.last_metrics)

    def where_it_is(self) -> None:
        """The run's last lines: its directory, checkpoint files and the TensorBoard command."""
        folder = self.trainer.ckpts.dir
        log.info("run directory: %s", self.cfg.run_dir)
        log.info("checkpoints: %s (in %s)", ", ".join(sorted(p.name for p in folder.glob("*.pt"))) or "none", folder)
        if self.cfg.train.tensorboard:
            log.info("TensorBoard: tensorboard --logdir %s", Path(self.cfg.run_dir) / "tb")

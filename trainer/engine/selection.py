"""Which checkpoint is the best: train.select_metric (the recipe's primary metric by default) and its mode, the
tie-break metric, and the early-stopping count, kept in the run's TrainState.

    selection = Selection(recipe, cfg, state)        # a resume that changed train.select_metric starts over
    if selection.improved(metrics): ...               # then selection.record(metrics): the new best
"""
from __future__ import annotations

import logging
from typing import Any

from trainer.config.settings import Config, ConfigError
from trainer.engine.capabilities import Evaluation, of
from trainer.engine.state import TrainState

log = logging.getLogger(__name__)


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
    """train.select_metric checked against the metrics the recipe reports (Evaluation.metric_names), before the run
    writes anything; a recipe that cannot tell before its first evaluation is checked there (Selection.improved)."""
    metric = selected_metric(cfg.train.select_metric, recipe.primary_metric)[0]
    names = of(recipe, Evaluation).metric_names() if cfg.train.select_metric.strip() else None
    if names is not None and metric not in names:
        raise ConfigError(unknown_metric(metric, cfg.recipe, names))


def unknown_metric(metric: str, recipe: str, names) -> str:
    return (f"train.select_metric: {metric!r} is not among the validation metrics of recipe {recipe}: "
            f"{', '.join(sorted(names))}")


def better(value: float, than: float, mode: str) -> bool:
    """value beats than under mode 'min' or 'max'."""
    return value < than if mode == "min" else value > than


class Selection:
    """The metric that picks best.pt and counts towards early stopping, over the run's state."""

    def __init__(self, recipe, cfg: Config, state: TrainState):
        self.recipe, self.recipe_name, self.state = recipe, cfg.recipe, state
        self.metric, self.mode = selected_metric(cfg.train.select_metric, recipe.primary_metric)
        self._follow()

    def _follow(self) -> None:
        """A resume whose train.select_metric differs from the metric of the checkpoint's best: the best so far
        and the early-stopping count start over (best.pt stays until a new best replaces it)."""
        state = self.state
        was = state.best_metric or self.recipe.primary_metric[0]
        if state.best is not None and was != self.metric:
            log.info("train.select_metric: best.pt and early stopping now follow %s (was %s, best %.5g): the best "
                     "so far starts over", self.metric, was, state.best)
            state.best, state.best_tie, state.bad_epochs = None, None, 0
        state.best_metric = self.metric

    def improved(self, metrics: dict[str, Any]) -> bool:
        """True when the selected metric beats the best so far (the tie-break metric decides between equals)."""
        if self.metric not in metrics:
            raise ConfigError(unknown_metric(self.metric, self.recipe_name, metrics))
        value, best = float(metrics[self.metric]), self.state.best
        if best is None:
            return True
        if value != best:
            return better(value, best, self.mode)
        tie, best_tie = of(self.recipe, Evaluation).tie_break_metric, self.state.best_tie
        return bool(tie) and tie[0] in metrics and best_tie is not None and \
            better(float(metrics[tie[0]]), best_tie, tie[1])

    def record(self, metrics: dict[str, Any]) -> bool:
        """An evaluation's metrics counted: True when they are the new best (else one more bad epoch)."""
        state = self.state
        if not self.improved(metrics):
            state.bad_epochs += 1
            return False
        state.best, state.bad_epochs = float(metrics[self.metric]), 0
        tie = of(self.recipe, Evaluation).tie_break_metric
        state.best_tie = float(metrics[tie[0]]) if tie and tie[0] in metrics else None
        return True

"""A run that is a search trial (search.study, search.trial: set by hpc/submit.py --search's array task): rank 0
reports each validation of the selection metric to the study, and the study's pruner may end the run there (exit 7,
pruned, never retried by a restart loop; `trainer runs` shows it pruned). Every rank gets rank 0's decision, so all
stop at the same point. A resumed trial does not report an epoch twice."""
from __future__ import annotations

import logging
from pathlib import Path

from trainer.distributed import runtime
from trainer.engine.callbacks import Component, RunContext, Stop
from trainer.engine.selection import selected_metric
from trainer.launch.exitcodes import PRUNED

log = logging.getLogger(__name__)


class SearchTrial(Component):
    """Reports the selection metric of each validation to trial search.trial of the study in search.study."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> SearchTrial | None:
        if not ctx.cfg.search.study:
            return None
        metric = selected_metric(ctx.cfg.train.select_metric, ctx.run.recipe.primary_metric)[0]
        return cls(Path(ctx.cfg.search.study), ctx.cfg.search.trial, metric, ctx.info)

    def __init__(self, folder: Path, number: int, metric: str, info):
        self.metric, self.info, self.number, self.value = metric, info, number, None
        self.trial = self.reported = None
        if info.is_main:
            from trainer.search.study import open_study, optuna
            study = open_study(folder)
            if not 0 <= number < len(study.trials):
                raise ValueError(f"search.trial={number}: the study in {folder} has trials 0..{len(study.trials) - 1}")
            frozen = study.trials[number]
            self.reported = set(frozen.intermediate_values)
            # a Trial bound to the trial the task claimed (Optuna's own integrations take its id the same way)
            self.trial = optuna().trial.Trial(study, frozen._trial_id)

    def evaluation_end(self, split: str, metrics: dict) -> None:
        if split == "val" and self.metric in metrics:
            self.value = float(metrics[self.metric])

    def evaluated(self, epoch: int, last: bool) -> Stop | None:
        prune = False
        if self.trial is not None and self.value is not None and epoch not in self.reported:
            self.trial.report(self.value, step=epoch)
            self.reported.add(epoch)
            prune = not last and self.trial.should_prune()
        self.value = None
        if not runtime.broadcast_object(prune, self.info):
            return None
        return Stop(f"search: trial {self.number} pruned by the study's pruner after epoch {epoch}", code=PRUNED)

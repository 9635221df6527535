"""Issue 71 point 2: train.select_metric, the validation metric that picks best.pt and drives early stopping: the
recipe's by default, any validation metric by name, recorded in the checkpoints' state, changeable on resume (the
best so far starts over, in one log line), a name the recipe does not report refused naming those it does."""
from __future__ import annotations

import pytest
import torch

from tests.inprocess import cli
from trainer.config.settings import ConfigError
from trainer.engine.selection import selected_metric

SAS = ("train", "--recipe", "sasrec", "log.tensorboard=false", "data.synthetic_users=120",
       "data.synthetic_items=200", "model.mhc=false", "model.time=false")


def test_the_setting_names_a_metric_and_its_direction():
    recipe = ("ndcg@10", "max")
    assert selected_metric("", recipe) == recipe and selected_metric("ndcg@10", recipe) == recipe
    assert selected_metric("full_ndcg@10", recipe) == ("full_ndcg@10", "max")
    assert selected_metric("val_loss", recipe) == ("val_loss", "min")
    assert selected_metric("full_hr@10:min", recipe) == ("full_hr@10", "min")
    with pytest.raises(ConfigError, match="max or min"):
        selected_metric("ndcg@10:up", recipe)


def test_a_resume_may_change_it_and_a_metric_the_recipe_does_not_report_is_refused(tmp_path):
    run = tmp_path / "run"
    cli(*SAS, "--epochs", "1", "train.select_metric=full_ndcg@10", "--run-dir", str(run))
    state = torch.load(run / "checkpoints" / "best.pt", weights_only=True)["state"]
    assert state["best_metric"] == "full_ndcg@10" and state["best"] is not None
    resumed = cli(*SAS, "--epochs", "2", "--resume", "auto", "train.select_metric=hr@10", "--run-dir", str(run))
    assert "train.select_metric 'full_ndcg@10' -> 'hr@10'" in resumed.stderr
    assert "best.pt and early stopping now follow hr@10 (was full_ndcg@10" in resumed.stderr
    state = torch.load(run / "checkpoints" / "best.pt", weights_only=True)["state"]
    assert state["best_metric"] == "hr@10"
    wrong = cli(*SAS, "--epochs", "1", "train.select_metric=ndcg@11", "--run-dir", str(tmp_path / "wrong"),
                    check=False)
    assert wrong.returncode == 2 and "train.select_metric: 'ndcg@11' is not among the validation metrics" in \
        wrong.stderr and "full_ndcg@10" in wrong.stderr
    # refused before the first step and before the run directory's first write (issue 82 point 4)
    assert "first step done" not in wrong.stderr and not (tmp_path / "wrong" / "config.yaml").exists()


# the recipes' generated data made small (the names do not depend on the data's size; the defaults' evaluation of
# SASRec's ranked every item for every user: 29 s)
SMALL = {"har": ["data.synthetic_cases=60"], "kgat": ["data.synthetic_users=60"], "sasrec": ["data.synthetic_users=60"],
         "video": ["data.synthetic_videos=4", "data.synthetic_frames=30"]}


@pytest.mark.parametrize("recipe,metric", [("har", "macro_f1"), ("kgat", "recall@20"), ("video", "accuracy"),
                                           ("sasrec", "full_ndcg@10")])
def test_each_recipe_tells_its_metrics_before_it_evaluates(recipe, metric):
    """The names Recipe.metric_names gives are the ones its evaluation reports (checked on a real evaluation)."""
    from trainer.config.settings import configure
    from trainer.distributed.runtime import DistInfo
    from trainer.engine.build import build_for_eval
    from trainer.engine.evaluation import evaluate_split
    from trainer.engine.session import build_recipe

    cfg, spec = configure(recipe, overrides=SMALL[recipe])
    cfg.run_dir = ""
    info = DistInfo()
    made = build_recipe(cfg, info, spec)
    run = build_for_eval(made, info, cfg)
    names = made.metric_names()
    assert metric in names
    assert names == set(evaluate_split(run, "val"))

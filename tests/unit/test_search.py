"""hpc/submit.py --search (issue 85 point 3) on this machine (--cluster debug: the array's tasks one after the other
in the test process; the local cluster's run is tests/slurm/test_search_on_cluster.py): an Optuna study in journal
storage, each task's trial claimed once and continued after a preemption, pruned trials ending with exit 7, the study's
best equal to `trainer runs`' best row, and the space file's errors naming the file, line and field."""
from __future__ import annotations

import csv
import io
import json
import textwrap

import pytest

from hpc import submit
from hpc.task import SearchTask
from tests.inprocess import cli, entry
from trainer.config.settings import ConfigError
from trainer.engine.logging import read_metrics
from trainer.launch.exitcodes import PRUNED, kind_of
from trainer.search.space import load_space
from trainer.search.study import claim_trial, create_study, open_study

SPACE = """\
metric: mse
startup_trials: 1
params:
  optim.lr: {low: 0.001, high: 0.5, log: true}
  model.hidden: {choices: [4, 8]}
"""


def write(tmp_path, text: str, name: str = "space.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """Six trials of the toy recipe, 4 epochs each, through hpc/submit.py --search --cluster debug."""
    root = tmp_path_factory.mktemp("search")
    space = write(root, SPACE)
    ran = entry(submit.main, ["--recipe", "toy", "--epochs", "4", "--search", str(space), "--trials", "6",
                              "--cluster", "debug", "--run-dir", str(root / "s"), "--folder", str(root / "submitit")])
    return root / "s", ran


def test_a_search_tells_every_trial_and_its_best_is_the_tables_best_row(search):
    folder, ran = search
    study = open_study(folder)
    states = [t.state.name for t in study.trials]
    assert len(states) == 6 and set(states) <= {"COMPLETE", "PRUNED"} and "COMPLETE" in states, states
    assert "PRUNED" in states, states            # lr down to 0.001 in 4 epochs: the median pruner stops some
    rows = list(csv.DictReader(io.StringIO(cli("runs", str(folder), "--format", "csv").stdout)))
    assert len(rows) == 6 and rows[0]["state"] == "completed"
    assert float(rows[0]["val mse (min)"]) == pytest.approx(study.best_value, rel=1e-3)
    assert rows[0]["run"] == f"{study.best_trial.user_attrs['slot']:03d}-trial{study.best_trial.number}"
    # each trial trained its own draw: the config of its run directory holds the values the study recorded
    for trial in study.trials:
        cfg = (folder / f"{trial.user_attrs['slot']:03d}-trial{trial.number}" / "config.yaml").read_text()
        assert f"lr: {trial.params['optim.lr']}" in cfg and f"hidden: {trial.params['model.hidden']}" in cfg
    assert len({json.dumps(t.params, sort_keys=True) for t in study.trials}) == 6      # no two tasks drew alike
    assert "python -m trainer runs" in ran.stdout


def test_a_pruned_trial_exits_7_and_is_never_retried(search):
    folder, _ = search
    pruned = [t for t in open_study(folder).trials if t.state.name == "PRUNED"]
    for trial in pruned:
        run = folder / f"{trial.user_attrs['slot']:03d}-trial{trial.number}"
        record = json.loads((run / "exits" / "rank-0.json").read_text())
        assert record["code"] == PRUNED and record["kind"] == "pruned", record
        epochs = sorted({r["epoch"] for r in read_metrics(run, "val")})
        assert epochs == sorted(trial.intermediate_values) and len(epochs) < 4     # stopped at the pruning point
    assert kind_of(PRUNED) == "pruned"
    from trainer.launch.exitcodes import NEVER_RETRIED
    assert PRUNED in NEVER_RETRIED


def test_a_preempted_task_continues_its_own_trial(tmp_path):
    """Task 0 SIGUSR1ed at step 6 (an agreed checkpoint, as a requeue leaves it), then run again: the same trial, in
    the same run directory, resumed, told once; no report of an epoch twice."""
    folder = tmp_path / "s"
    space = load_space(write(tmp_path, SPACE))
    create_study(folder, space, "mse", "min", 1)
    base = ["--recipe", "toy", "--epochs", "3", "train.select_metric=mse"]
    first = SearchTask([*base, "data.signal_at_step=6", "data.signal_name=SIGUSR1"], str(folder), 0)
    with_env = entry(lambda argv: print(json.dumps(first())), [], env=None)
    summary = json.loads(with_env.stdout.strip().splitlines()[-1])
    assert summary["status"] == "preempted" and "told" not in summary
    claim = claim_trial(folder, 0)
    assert open_study(folder).trials[claim.trial].state.name == "RUNNING"
    again = entry(lambda argv: print(json.dumps(SearchTask(base, str(folder), 0)())), [])
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["trial"] == claim.trial and summary["told"] == "complete", summary
    study = open_study(folder)
    assert len(study.trials) == 1 and study.trials[0].state.name == "COMPLETE"
    assert sorted(study.trials[0].intermediate_values) == [0, 1, 2]
    log = (folder / "000-trial0" / "train.log").read_text()
    assert "resumed from" in log


@pytest.mark.parametrize("text, where, what", [
    ("params:\n  optim.lr: {low: 0.1, high: 0.01}\n", ":2:", "params.optim.lr: low 0.1 must be below high 0.01"),
    ("params:\n  optim.lr: {low: 0, high: 1, log: true}\n", ":2:", "log: true needs low > 0"),
    ("metric: mse\nparams:\n  optim.lr: {low: 0.1, hgh: 1}\n", ":3:", "unknown field 'hgh'"),
    ("params:\n  lr: {low: 0.1, high: 1}\n", ":2:", "'lr' is not a config key"),
    ("pruner: hyperband\nparams:\n  optim.lr: {low: 0.1, high: 1}\n", ":1:", "pruner: 'hyperband': one of median"),
    ("params:\n  model.hidden: {choices: []}\n", ":2:", "choices: a non-empty list"),
    ("trials: 4\nparams:\n  optim.lr: {low: 0.1, high: 1}\n", ":1:", "unknown field 'trials'"),
    ("params: {}\n", ":1:", "params: a mapping of config keys"),
    ("params:\n  optim.lr: {low: 0.1, high: 1}\n  optim.lr: {low: 0.2, high: 1}\n", ":3:", "given twice"),
])
def test_a_bad_space_file_names_its_line_and_field(tmp_path, text, where, what):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_space(path)
    assert str(path) in str(err.value) and where in str(err.value) and what in str(err.value), err.value


def test_a_space_file_parses_to_its_distributions(tmp_path):
    space = load_space(write(tmp_path, SPACE + "  model.dropout: {low: 0.0, high: 0.5, step: 0.1}\n"
                                                "  train.batch_size: {low: 16, high: 64, log: true}\n"))
    lr, hidden, dropout, batch = (space.params[k] for k in ("optim.lr", "model.hidden", "model.dropout",
                                                              "train.batch_size"))
    assert (lr.kind, lr.low, lr.high, lr.log) == ("float", 0.001, 0.5, True)
    assert (hidden.kind, hidden.choices) == ("choices", (4, 8))
    assert (dropout.kind, dropout.step) == ("float", 0.1)
    assert (batch.kind, batch.low, batch.high, batch.log) == ("int", 16, 64, True)
    assert space.metric == "mse" and space.pruner == "median" and space.startup_trials == 1


def submit_dry(tmp_path, *argv):
    return entry(submit.main, ["--recipe", "toy", "--dry-run", "--folder", str(tmp_path / "sub"), *argv], check=False)


def test_submit_checks_a_search_before_anything_is_submitted(tmp_path):
    space = write(tmp_path, SPACE)
    ran = submit_dry(tmp_path, "--search", str(space), "--trials", "6", "--array-parallelism", "3",
                     "--run-dir", str(tmp_path / "s"))
    assert ran.returncode == 0, ran.stderr
    assert "#SBATCH --array=0-5%3" in ran.stdout
    assert "6 trials of optim.lr, model.hidden" in ran.stderr and "optimising mse:min" in ran.stderr
    assert not (tmp_path / "s").exists()                        # a dry run creates no study
    refusals = [
        (("--search", str(space)), "--search SPACE.yaml and --trials N go together"),
        (("--search", str(space), "--trials", "0"), "--trials 0: must be >= 1"),
        (("--search", str(space), "--trials", "2", "--sweep", "optim.lr=0.1,0.2"), "exclude each other"),
        (("--search", str(write(tmp_path, "params:\n  model.hiden: {low: 1, high: 4}\n", "typo.yaml")),
          "--trials", "2"), "hiden"),
        (("--search", str(write(tmp_path, "params:\n  model.hidden: {low: 0, high: 4}\n", "low.yaml")),
          "--trials", "2"), "model.hidden"),
        (("--search", str(tmp_path / "missing.yaml"), "--trials", "2"), "no such file"),
    ]
    for argv, message in refusals:
        ran = submit_dry(tmp_path, *argv)
        assert ran.returncode == 2 and message in ran.stderr, (argv, ran.stderr)


def test_a_failed_trial_is_told_failed_and_the_study_goes_on(tmp_path):
    """Task 0's trial ends with a non-finite loss (exit 3): told FAIL, its error raised to the job; task 1 draws the
    next trial and completes it."""
    from trainer.engine.window import NonFiniteLossError
    folder = tmp_path / "s"
    create_study(folder, load_space(write(tmp_path, SPACE)), "mse", "min", 2)
    base = ["--recipe", "toy", "--epochs", "2", "train.select_metric=mse"]

    def failing(argv):
        SearchTask([*base, "data.nan_at_step=3"], str(folder), 0)()
    with pytest.raises(NonFiniteLossError):
        entry(failing, [])
    entry(lambda argv: SearchTask(base, str(folder), 1)() and 0, [])
    study = open_study(folder)
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(cli("runs", str(folder), "--format", "csv").stdout))}
    assert rows["000-trial0"]["state"] == "failed" and rows["000-trial0"]["cause"].startswith("exit 3")
    said = cli("runs", str(folder), "--rerun-failed").stderr
    assert "failed trials in array tasks 0" in said and "--trials N adds N trials to the same study" in said


def test_a_task_run_again_after_its_trial_was_told_trains_nothing(tmp_path):
    """A task that comes back after its trial ended (a requeue racing the end): its claim says which trial, the study
    says it was told; no training, on any rank."""
    folder = tmp_path / "s"
    create_study(folder, load_space(write(tmp_path, SPACE)), "mse", "min", 1)
    base = ["--recipe", "toy", "--epochs", "1", "train.select_metric=mse"]
    entry(lambda argv: SearchTask(base, str(folder), 0)() and 0, [])
    steps = len(read_metrics(folder / "000-trial0", "train"))
    again = entry(lambda argv: print(json.dumps(SearchTask(base, str(folder), 0)())), [])
    assert json.loads(again.stdout.strip().splitlines()[-1])["status"] == "told before"
    assert len(read_metrics(folder / "000-trial0", "train")) == steps and len(open_study(folder).trials) == 1

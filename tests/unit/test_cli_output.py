"""A CLI that catches typos and output a newcomer can read (issue 47, points 3 and 4): no abbreviated flags, "did
you mean" with the subcommand's usage, a key without its section matched, `eval` of a run directory with a table,
train's last lines, per-class scores of absent classes, progress bars apart from log lines."""
import ast
import io
import json
import logging
import re
import subprocess

import pytest
import torch

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.distributed.runtime import DistInfo
from trainer.engine.logging import setup_logging
from trainer.native.console import progress_bar
from trainer.recipes.classify.metrics import classification_metrics

TOY = ("--recipe", "toy", "--seed", "1", "log.tensorboard=false")


@pytest.mark.parametrize("typo,meant", [("--epoch", "--epochs"), ("--epcohs", "--epochs"), ("--batch", "--batch-size")])
def test_an_abbreviated_or_mistyped_flag_is_refused_with_a_suggestion_and_the_subcommands_usage(typo, meant):
    out = cli("train", *TOY, typo, "3", "--print-config", check=False)
    assert out.returncode == 2
    assert f"unrecognized argument {typo} (did you mean {meant}?)" in out.stderr
    assert "usage: trainer train" in out.stderr


def test_submit_refuses_abbreviations_too():
    out = subprocess.run([PY, "hpc/submit.py", *TOY, "--node", "2", "--dry-run"], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=limit("run"))
    assert out.returncode == 2 and "unrecognized argument --node (did you mean --nodes?)" in out.stderr


def test_every_parser_in_the_repository_refuses_abbreviations():
    """argparse's default allow_abbrev=True takes --epoch for --epochs: every parser is trainer.cli.parser.Parser or
    passes allow_abbrev=False."""
    offenders = []
    for path in [*REPO.glob("trainer/**/*.py"), *REPO.glob("hpc/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) \
                    == "ArgumentParser":
                flags = {k.arg: k.value for k in node.keywords}
                if not (isinstance(flags.get("allow_abbrev"), ast.Constant) and flags["allow_abbrev"].value is False):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("key,meant", [("epochs=3", "train.epochs"), ("train.epcohs=3", "train.epochs"),
                                       ("hiden=3", "model.hidden")])
def test_a_key_without_its_section_or_mistyped_gets_its_best_match(key, meant):
    out = cli("train", *TOY, key, "--print-config", check=False)
    assert out.returncode == 2 and f"Did you mean {meant!r}?" in out.stderr
    if "." not in key:
        assert len(out.stderr) < 600, "the top level lists its sections, not every key"


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    out = cli("train", *TOY[:-1], "--epochs", "2", "--run-dir", str(root / "run"))
    return root / "run", out.stderr


def test_train_ends_with_where_everything_is(toy_run):
    run_dir, err = toy_run
    tail = err.strip().splitlines()[-3:]
    assert tail[0].endswith(f"run directory: {run_dir}")
    assert re.search(r"checkpoints: best.pt, final.pt, step-\d+\.pt", tail[1])
    assert str(run_dir / "checkpoints") in tail[1]
    assert tail[2].endswith(f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    assert "test (final checkpoint) after epoch 1" in err
    assert "test (best checkpoint) after epoch 1" in err or "test (best checkpoint): the final checkpoint" in err


def test_eval_of_a_run_directory_names_its_file_prints_a_table_and_writes_the_json(toy_run, tmp_path):
    run_dir, _ = toy_run
    out = cli("eval", "--checkpoint", str(run_dir), "--out", str(tmp_path / "m.json"))
    assert out.stdout.splitlines()[0].startswith(f"{run_dir / 'checkpoints' / 'best.pt'} (best checkpoint, step ")
    assert re.search(r"^metric\s+val\s+test$", out.stdout, re.M) and re.search(r"^mse\s+[\d.]+\s+[\d.]+$", out.stdout,
                                                                                 re.M)
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["checkpoint"] == str(run_dir / "checkpoints" / "best.pt") and set(report) >= {"val", "test"}
    assert f"evaluating {run_dir / 'checkpoints' / 'best.pt'}" in out.stderr


def test_eval_of_a_run_directory_with_a_damaged_best_falls_back_to_final_naming_both(toy_run, tmp_path):
    """Issue 57: a zero-byte best.pt does not fail `eval RUN_DIR` while final.pt is there."""
    import shutil
    run_dir, _ = toy_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
    (copy / "checkpoints" / "best.pt").write_bytes(b"")
    out = cli("eval", "--checkpoint", str(copy))
    best, final = copy / "checkpoints" / "best.pt", copy / "checkpoints" / "final.pt"
    assert f"warning: checkpoint {best} is truncated, corrupt or unsafe" in out.stderr
    assert f"evaluating {final} instead" in out.stderr
    assert out.stdout.splitlines()[0].startswith(f"{final} (final checkpoint, step ")


def test_epochs_zero_says_no_training_ran(tmp_path):
    """Issue 57: --epochs 0 ends with an untrained final.pt evaluated; the log says so."""
    out = cli("train", *TOY[:-1], "--epochs", "0", "--run-dir", str(tmp_path / "run"))
    assert "no training ran: the run is at epoch 0 and --epochs is 0 (step 0)" in out.stderr
    assert "of untrained weights" in out.stderr


def test_a_glob_matching_several_checkpoints_is_refused_by_name(toy_run):
    run_dir, _ = toy_run
    files = sorted(str(p) for p in (run_dir / "checkpoints").glob("*.pt"))
    out = cli("eval", "--checkpoint", *files, check=False)
    assert out.returncode == 2 and f"--checkpoint matched {len(files)} paths ({', '.join(files)})" in out.stderr


def test_a_class_without_cases_in_the_split_has_no_f1_and_macro_f1_skips_it():
    cm = torch.tensor([[3.0, 1.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 0.0]])   # class c: no true case
    m = classification_metrics(cm, ["a", "b", "c"])
    assert m["f1/c"] is None and m["f1/a"] == pytest.approx(6 / 7)
    assert m["macro_f1"] == pytest.approx((6 / 7 + 8 / 9) / 2)


def test_log_lines_and_a_progress_bar_do_not_share_a_line(tmp_path, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    setup_logging(DistInfo(rank=0, world_size=1))
    bar = progress_bar(total=10, file=stream, desc="epoch 0", ncols=60)
    bar.update(3)
    logging.getLogger("trainer.test").info("a log line")
    bar.update(3)
    bar.close()
    logging.getLogger().handlers.clear()
    lines = re.split(r"[\r\n]", stream.getvalue())
    mine = [line for line in lines if "a log line" in line]
    assert mine and all("epoch 0" not in line for line in mine), stream.getvalue()


def test_version_names_the_package_commit_and_stack():
    out = subprocess.run([PY, "-m", "trainer", "--version"], cwd=REPO, env=clean_env(), capture_output=True,
                         text=True, timeout=limit("minute"))
    assert out.returncode == 0
    first, second = out.stdout.strip().splitlines()
    assert re.match(r"hpc-trainer \d+\.\d+\.\d+\S* \(commit [0-9a-f]{7,}", first), first
    assert re.match(r"torch \S+, CUDA \S+, NCCL \S+, python 3\.\d+", second), second


def test_a_second_recipe_under_a_taken_name_is_an_error():
    from trainer.config.registry import DuplicateRecipeError, get_spec, register
    from trainer.config.spec import RecipeSpec
    har = get_spec("har")
    assert register(har) is har                                      # the same recipe again: fine
    with pytest.raises(DuplicateRecipeError, match="recipe name 'har' is taken by trainer.recipes.har.recipe"):
        register(RecipeSpec(name="har", recipe="tests.toy_recipe:ToyRecipe"))
    assert get_spec("har") is har

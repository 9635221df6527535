"""`python -m trainer runs DIR` (issue 85 point 4): a sweep's folder of real toy runs read as one table (the varied
settings, each run's state and cause, best epoch and metrics, best first) in text, CSV and Markdown, the PNG, and the
failed points' indices, which hpc/submit.py --sweep-points submits again."""
from __future__ import annotations

import csv
import fcntl
import io
import shutil

import pytest

from hpc import submit
from tests.inprocess import cli, entry
from trainer.engine.logging import read_metrics

LRS = ("0.1", "0.01", "0.001")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """000..002: completed at three lrs; 003: failed (a NaN loss at step 3); 004: stopped (a copy of 000 without its
    exit record: killed); 005: a copy of 001 whose lock a live process holds (running)."""
    root = tmp_path_factory.mktemp("sweep")
    for i, lr in enumerate(LRS):
        cli("train", "--recipe", "toy", "--epochs", "2", "--run-dir", str(root / f"00{i}-optim.lr-{lr}"),
            f"optim.lr={lr}")
    cli("train", "--recipe", "toy", "--epochs", "2", "--run-dir", str(root / "003-optim.lr-1"), "optim.lr=1",
        "data.nan_at_step=3", check=False)
    shutil.copytree(root / "000-optim.lr-0.1", root / "004-optim.lr-0.1")
    shutil.rmtree(root / "004-optim.lr-0.1" / "exits")
    shutil.copytree(root / "001-optim.lr-0.01", root / "005-optim.lr-0.01")
    with open(root / "005-optim.lr-0.01" / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield root


def table(*args: str) -> tuple[int, str, str]:
    ran = cli("runs", *args, check=False)
    return ran.returncode, ran.stdout, ran.stderr


def best_mse(run) -> float:
    return min(r["mse"] for r in read_metrics(run, "val"))


def test_the_table_is_best_first_with_the_varied_settings_and_each_runs_state(sweep):
    code, out, _ = table(str(sweep), "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    header = list(rows[0])
    assert header[:3] == ["run", "data.nan_at_step", "optim.lr"] and header[3] == "state"    # only what differs
    assert header[4:7] == ["best_epoch", "val mse (min)", "test mse"] and header[-1] == "cause"
    by_name = {r["run"]: r for r in rows}
    assert [by_name[f"00{i}-optim.lr-{lr}"]["state"] for i, lr in enumerate(LRS)] == ["completed"] * 3
    stopped = by_name["004-optim.lr-0.1"]
    assert stopped["state"] == "stopped" and "no exit record" in stopped["cause"]
    assert by_name["005-optim.lr-0.01"]["state"] == "running"
    failed = by_name["003-optim.lr-1"]
    assert failed["state"] == "failed" and failed["cause"].startswith("exit 3: ") and failed["val mse (min)"] == ""
    scored = [r for r in rows if r["val mse (min)"]]
    values = [float(r["val mse (min)"]) for r in scored]
    assert values == sorted(values) and rows[-1]["run"] == "003-optim.lr-1"      # mse is minimised; no value: last
    first = sweep / scored[0]["run"]
    assert float(scored[0]["val mse (min)"]) == pytest.approx(best_mse(first), rel=1e-3)
    assert scored[0]["best_epoch"] in ("0", "1")


def test_the_same_table_as_text_and_markdown_and_by_another_metric(sweep):
    _, text, _ = table(str(sweep))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["run", "data.nan_at_step", "optim.lr"] and len(lines) == 7
    _, md, _ = table(str(sweep), "--format", "md")
    assert md.splitlines()[1].startswith("|---|") and md.count("\n") == 8
    _, by_max, _ = table(str(sweep), "--format", "csv", "--metric", "mse:max")      # the worst first now
    rows = [r for r in csv.DictReader(io.StringIO(by_max)) if r["val mse (max)"]]
    values = [float(r["val mse (max)"]) for r in rows]
    assert values == sorted(values, reverse=True)


def test_the_plot_and_the_failed_points_to_rerun(sweep, tmp_path):
    code, _, err = table(str(sweep), "--plot", str(tmp_path / "runs.png"), "--rerun-failed")
    assert code == 0 and (tmp_path / "runs.png").stat().st_size > 10_000
    assert "failed points: 3,4\n" in err and "--sweep-points 3,4" in err


def test_a_folder_without_runs_and_a_missing_folder_are_refused_by_name(tmp_path):
    code, _, err = table(str(tmp_path))
    assert code == 2 and f"{tmp_path}: no run directory there" in err
    code, _, err = table(str(tmp_path / "nope"))
    assert code == 2 and "nope: no such directory" in err


def dry(*argv: str):
    return entry(submit.main, ["--recipe", "toy", "--dry-run", "--sweep", "optim.lr=0.1,0.01,0.001", *argv],
                 check=False)


def test_sweep_points_submit_only_those_points_into_their_own_folders(tmp_path):
    ran = dry("--run-dir", str(tmp_path / "sweep"), "--sweep-points", "2,0")
    assert ran.returncode == 0, ran.stderr
    tasks = [line for line in ran.stderr.splitlines() if line.startswith("# task:")]
    assert len(tasks) == 2 and "000-optim.lr-0.1 " in tasks[0] and "002-optim.lr-0.001 " in tasks[1]
    assert all("--resume auto" in t for t in tasks) and "#SBATCH --array=0-1" in ran.stdout
    for argv, said in ((["--run-dir", str(tmp_path), "--sweep-points", "3"], "the grid has points 0..2"),
                       (["--run-dir", str(tmp_path), "--sweep-points", "a"], "expected indices such as 1,4"),
                       (["--sweep-points", "1"], "give the sweep's --run-dir")):
        ran = dry(*argv)
        assert ran.returncode == 2 and said in ran.stderr, (argv, ran.stderr)

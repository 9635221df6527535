"""Exit codes that say what happened (issue 48, point 0): the table of trainer/launch/exitcodes.py, and each rank's own
record of its exit in RUN_DIR/exits/rank-<N>.json (srun merges the tasks' statuses into one)."""
import json
import signal
import subprocess

from tests.conftest import PY, REPO, clean_env, launch_ranks, trainer, wait_all
from tests.timeouts import limit
from trainer.launch.exitcodes import kind_of

TOY = ("train", "--recipe", "toy", "--epochs", "2", "--seed", "1", "log.tensorboard=false")


def records(run_dir):
    found = sorted((run_dir / "exits").glob("rank-*.json"))
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in found}


def test_the_table():
    assert kind_of(4) == "resource"
    assert [kind_of(c) for c in (0, 2, 3, 1, 139, 143)] == ["done", "usage", "non-finite", "retryable", "retryable",
                                                            "retryable"]
    assert kind_of(143, preempted=True) == "preempted" and kind_of(1, preempted=True) == "retryable"


def test_done_and_a_checkpointed_signal_are_recorded_per_rank(tmp_path):
    trainer(*TOY, "--run-dir", str(tmp_path / "done"))
    done = records(tmp_path / "done")
    assert done[0]["code"] == 0 and done[0]["kind"] == "done" and done[0]["cause"] == "completed"
    stopped = trainer(*TOY, "--run-dir", str(tmp_path / "sig"), "data.signal_at_step=3", check=False)
    assert stopped.returncode == 128 + signal.SIGTERM
    rec = records(tmp_path / "sig")[0]
    assert rec["code"] == 143 and rec["kind"] == "preempted" and rec["host"] and rec["pid"] > 0


def test_a_non_finite_loss_exits_3_on_every_rank_and_says_so(tmp_path):
    results = wait_all(launch_ranks(2, *TOY, "--run-dir", str(tmp_path / "run"), "data.nan_at_step=3",
                                    "data.nan_rank=1"))
    assert [code for code, _ in results] == [3, 3], results[0][1][-2000:]
    recs = records(tmp_path / "run")
    assert sorted(recs) == [0, 1]
    assert all(r["kind"] == "non-finite" and "non-finite loss at step 3" in r["cause"] for r in recs.values())


def test_a_crash_exits_non_zero_as_retryable_with_its_cause(tmp_path):
    code = ("import sys, tests.toy_recipe as r\n"
            "def boom(self, m, b):\n    raise RuntimeError('loader worker died (injected)')\n"
            "r.ToyRecipe.training_step = boom\n"
            "from trainer.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([PY, "-c", code, *TOY, "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    rec = records(tmp_path / "run")[0]
    assert rec["kind"] == "retryable" and rec["cause"] == "RuntimeError: loader worker died (injected)"

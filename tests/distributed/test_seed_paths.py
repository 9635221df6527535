"""Paths that users of the seed scripts take: torch.distributed.launch (with and without --use-env) and
torchrun with 2 processes, a NaN loss (seed checklist: stop naming the step, keep the last good
checkpoint), and weights-only initialisation from another run (seed 001's --state_dict_path)."""
import subprocess

import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, launch_ranks, trainer, wait_all, weights
from tests.inprocess import cli
from tests.timeouts import limit

RUN = ("--recipe", "toy", "--epochs", "1", "--seed", "2", "log.tensorboard=false")


@pytest.mark.long     # launcher process groups: make test-fast leaves it out
@pytest.mark.parametrize("launcher", [["-m", "torch.distributed.launch"],
                                      ["-m", "torch.distributed.launch", "--use-env"],
                                      ["-m", "torch.distributed.run"]])
def test_two_processes_under_the_seed_launchers(tmp_path, launcher):
    """torch.distributed.launch passes --local-rank=N to the script (unless --use-env)."""
    proc = subprocess.run([PY, *launcher, "--nproc-per-node", "2", "-m", "trainer", "train", *RUN,
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("start"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world=2" in (tmp_path / "run" / "train.log").read_text()


def test_a_local_rank_argument_that_disagrees_with_the_environment_is_refused(tmp_path):
    proc = trainer("train", *RUN, "--local-rank=1", "--run-dir", str(tmp_path / "r"), check=False,
                   env=clean_env(LOCAL_RANK="0"))
    assert proc.returncode == 2 and "--local-rank=1 but LOCAL_RANK=0" in proc.stderr


def test_a_nan_loss_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = ("train", *RUN, "--epochs", "3", "--batch-size", "16", "ckpt.every_steps=4", "ckpt.every_epochs=0",
            "--run-dir", str(run_dir))
    results = wait_all(launch_ranks(2, *args, "data.nan_at_step=10", "data.nan_rank=1"))
    assert [code for code, _ in results] == [3, 3], results[0][1][-2000:]      # 3: non-finite (exitcodes.py)
    assert "non-finite loss at step 10 (epoch 1, batch 2)" in results[0][1]
    assert f"the last good checkpoint is {run_dir}/checkpoints/step-00000008.pt" in results[0][1]
    assert "Traceback" not in results[0][1]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names[-1] == "step-00000008.pt" and "final.pt" not in names
    resumed = wait_all(launch_ranks(2, *args, "--resume", "auto"))
    assert [code for code, _ in resumed] == [0, 0] and "step-00000008.pt" in resumed[0][1]


def test_init_from_takes_the_weights_only(tmp_path):
    cli("train", *RUN, "--run-dir", str(tmp_path / "a"))
    source = tmp_path / "a" / "checkpoints" / "final.pt"
    out = cli("train", *RUN, "--epochs", "0", "--init-from", str(source), "--run-dir", str(tmp_path / "b"))
    assert f"initial weights from {source} (step 8 of that run)" in out.stderr
    assert_bitwise_equal(weights(tmp_path / "b"), weights(tmp_path / "a"))
    import torch
    b = torch.load(tmp_path / "b" / "checkpoints" / "final.pt", weights_only=True)
    assert b["global_step"] == 0 and b["optimizer"]["state"] == {}       # no optimizer state came along
    other = cli("train", *RUN, "model.hidden=32", "--init-from", str(source), "--run-dir", str(tmp_path / "c"),
                check=False)
    assert other.returncode == 2 and "does not fit this model" in other.stderr

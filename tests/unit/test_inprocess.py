"""tests/inprocess.py cli(): the command line inside the test process gives what the subprocess gives (the same
weights, bit for bit; the exit codes of a refusal and of a usage error) and leaves the test process as it was."""
from __future__ import annotations

import logging
import os

import torch

from tests.conftest import assert_bitwise_equal, trainer, weights
from tests.inprocess import cli

TOY = ("train", "--recipe", "toy", "--epochs", "2", "--seed", "5", "log.tensorboard=false")


def test_a_training_in_process_has_the_weights_of_the_same_training_as_a_subprocess(tmp_path):
    inside = cli(*TOY, "--run-dir", str(tmp_path / "inside"))
    outside = trainer(*TOY, "--run-dir", str(tmp_path / "outside"))
    assert inside.returncode == outside.returncode == 0
    assert all("training completed after 16 steps" in ran.stderr for ran in (inside, outside))
    assert_bitwise_equal(weights(tmp_path / "inside"), weights(tmp_path / "outside"))


def test_refusals_and_usage_errors_answer_with_the_subprocess_codes(tmp_path):
    typo = cli("train", "--recipe", "toy", "--epcohs", "1", check=False)
    assert typo.returncode == 2 and "did you mean --epochs?" in typo.stderr
    range_error = cli(*TOY, "--epochs", "-3", "--run-dir", str(tmp_path / "never"), check=False)
    assert range_error.returncode == 2 and "out of range" in range_error.stderr
    assert not (tmp_path / "never").exists()
    assert cli("train", "--help").returncode == 0


def test_the_test_process_is_left_as_it_was(tmp_path):
    before = (dict(os.environ), os.getcwd(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    umask = os.umask(0o022)
    os.umask(umask)
    handlers = list(logging.getLogger().handlers)
    cli(*TOY, "--epochs", "1", "--run-dir", str(tmp_path / "run"), "train.deterministic=true", "--private",
        env={**os.environ, "TRAINER_PLUGINS": "tests.toy_recipe", "OMP_NUM_THREADS": "1", "MY_VAR": "x"})
    after_umask = os.umask(umask)
    assert (dict(os.environ), os.getcwd(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) \
        == before and "MY_VAR" not in os.environ
    assert after_umask == umask and logging.getLogger().handlers == handlers
    assert (tmp_path / "run" / "checkpoints" / "final.pt").stat().st_mode & 0o077 == 0      # --private held inside


def test_a_pythonpath_of_its_own_is_refused_with_what_to_do_instead(tmp_path):
    import pytest

    from tests.conftest import clean_env
    with pytest.raises(ValueError, match="run this one as a process"):
        cli("doctor", env=clean_env(PYTHONPATH=str(tmp_path)))

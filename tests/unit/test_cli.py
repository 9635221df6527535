"""The one parser: help lists recipes, flags map to config keys, reuse through parents=."""
import argparse
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.cli.parser import FLAG_KEYS, flags_from_args, get_parser, get_train_parser
from trainer.native.extras import missing_core


@pytest.fixture(autouse=True)
def toy_recipe(monkeypatch):
    """The in-process parsers list the toy recipe too (not only when another module set it up first)."""
    monkeypatch.setenv("TRAINER_PLUGINS", "tests.toy_recipe")


def test_help_lists_registered_recipes():
    out = cli("train", "--help").stdout
    assert "toy" in out and "--global-batch-size" in out and "key=value" in out
    assert "toy" in cli("--help").stdout


def test_flags_map_to_config_keys():
    args = get_parser().parse_args(["train", "--recipe", "toy", "--epochs", "2", "--batch-size", "8",
                                    "--gpu-ids", "0,1", "--amp", "bf16", "--resume", "auto", "optim.lr=0.1"])
    flags = flags_from_args(args)
    assert flags == {"train.epochs": 2, "train.batch_size": 8, "dist.gpu_ids": [0, 1], "train.amp": "bf16",
                     "ckpt.resume": "auto"}
    assert args.overrides == ["optim.lr=0.1"]
    assert set(FLAG_KEYS) <= set(vars(args))


def test_parser_reusable_with_parents():
    p = argparse.ArgumentParser(parents=[get_train_parser()])
    p.add_argument("--nodes", type=int, default=1)
    args = p.parse_args(["--nodes", "2", "--recipe", "toy", "--lr", "0.5", "model.hidden=4"])
    assert args.nodes == 2 and flags_from_args(args) == {"optim.lr": 0.5}
    assert args.overrides == ["model.hidden=4"]


def test_bad_flag_value_rejected():
    with pytest.raises(SystemExit):
        get_parser().parse_args(["train", "--recipe", "toy", "--amp", "fp8"])


def test_unknown_key_is_a_clear_error_exit_2(tmp_path):
    proc = cli("train", "--recipe", "toy", "--run-dir", str(tmp_path), "train.nope=1", check=False)
    assert proc.returncode == 2
    assert "unknown config key 'train.nope'" in proc.stderr and "train.epochs" in proc.stderr


def test_indivisible_global_batch_is_a_clear_error(tmp_path):
    proc = cli("train", "--recipe", "toy", "--run-dir", str(tmp_path), "--global-batch-size", "10",
                   "--grad-accum-steps", "4", check=False)
    assert proc.returncode == 2 and "not divisible" in proc.stderr and "HINT" in proc.stderr


def test_python_under_sbatch_without_srun_is_refused(tmp_path):
    env = clean_env(SLURM_JOB_ID="5", SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="n[1-2]")
    proc = cli("train", "--recipe", "toy", "--run-dir", str(tmp_path), env=env, check=False)
    assert proc.returncode == 2 and "without srun" in proc.stderr and "HINT" in proc.stderr


def test_console_script_installed_next_to_python():
    import subprocess
    import sys
    from pathlib import Path
    exe = Path(sys.executable).parent / "trainer"
    if not exe.exists():
        pytest.skip(f"no console script at {exe}: the package is not pip-installed in this interpreter "
                    f"(`make setup` installs it)")
    out = subprocess.run([str(exe), "--help"], env=clean_env(), capture_output=True, text=True, timeout=limit("minute"))
    assert out.returncode == 0 and "{train,eval,predict,doctor,runs,data}" in out.stdout


def test_print_config_shows_the_resolved_config_and_starts_nothing(tmp_path):
    """Issue 19.7: defaults < YAML < flags < key=value, printed as YAML; no run directory is made."""
    import subprocess

    import yaml

    from tests.conftest import PY, REPO, clean_env
    y = tmp_path / "c.yaml"
    y.write_text("recipe: toy\noptim:\n  lr: 0.5\ntrain:\n  epochs: 7\nmodel:\n  hidden: 8\n")
    out = subprocess.run([PY, "-m", "trainer", "train", "--config", str(y), "--epochs", "3", "model.hidden=5",
                          "--run-dir", str(tmp_path / "never"), "--print-config"], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert (cfg["optim"]["lr"], cfg["train"]["epochs"], cfg["model"]["hidden"]) == (0.5, 3, 5)
    assert cfg["train"]["batch_size"] == 32 and "loss" in cfg          # defaults and every section
    assert not (tmp_path / "never").exists()
    helped = subprocess.run([PY, "-m", "trainer", "train", "--help"], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True).stdout
    assert "--print-config" in helped and "loss.*" in helped


def test_a_python_without_torch_gets_the_interpreter_to_use_not_a_traceback():
    """A newcomer's `python3 -m trainer ...` with the project's .venv not activated: import torch fails."""
    blocked = "import sys, runpy; sys.modules['torch'] = None; runpy.run_module('trainer', run_name='__main__')"
    proc = subprocess.run([PY, "-c", blocked, "train", "--recipe", "toy"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("minute"))
    assert proc.returncode == 2, proc.stderr
    assert "has no 'torch' module (the package 'torch==2.13.0')" in proc.stderr
    assert "HINT:" in proc.stderr and "Traceback" not in proc.stderr


def test_only_the_trainers_own_dependencies_get_that_message():
    assert "'pyyaml'" in missing_core(ModuleNotFoundError("No module named 'yaml'", name="yaml"))
    assert missing_core(ModuleNotFoundError("No module named 'trainer.nope'", name="trainer.nope")) is None


def test_the_benchmarks_give_the_same_message():
    blocked = "import sys, runpy; sys.modules['torch'] = None; runpy.run_module('bench', run_name='__main__')"
    proc = subprocess.run([PY, "-c", blocked, "har"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("minute"))
    assert proc.returncode == 2 and "has no 'torch' module" in proc.stderr and "Traceback" not in proc.stderr

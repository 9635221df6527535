"""Generated data by accident (issue 73 point 4): a run under Slurm or submitit whose data.path is empty stops at once
unless data.synthetic=true; `hpc/submit.py` refuses it before submitting and its --dry-run says what the tasks train
on; a local run still trains on generated data (the README's first commands), saying so; data.synthetic=true beside
a data.path is refused."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.config.data_source import check_generated_data
from trainer.config.settings import ConfigError

ONE_SRUN_TASK = dict(SLURM_JOB_ID="5", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_ID="0",
                     SLURM_NTASKS="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="node1", SLURM_STEP_NUM_TASKS="1")


def test_the_rule():
    data = SimpleNamespace(path="", synthetic=False)
    assert check_generated_data(data, "local") == "generated data (data.path is empty)"
    assert check_generated_data(data, "torchrun") == "generated data (data.path is empty)"
    for launcher in ("slurm", "submitit"):
        with pytest.raises(ConfigError, match=rf"data.path is empty: this {launcher} run would train on the recipe's "
                                              r"generated data.\nHINT: set data.path=DIR .* or data.synthetic=true"):
            check_generated_data(data, launcher)
    data.synthetic = True
    assert check_generated_data(data, "slurm") == "generated data (data.path is empty)"
    data.path = "data/ml-1m"
    with pytest.raises(ConfigError, match="data.synthetic=true and data.path=data/ml-1m: one or the other"):
        check_generated_data(data, "local")
    data.synthetic = False
    assert check_generated_data(data, "slurm") == "data.path=data/ml-1m"
    assert check_generated_data(SimpleNamespace(path=""), "slurm") is None     # a recipe that only generates (toy)


def test_an_srun_task_without_data_path_stops_before_the_process_group(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", "--recipe", "har", "--epochs", "1", "--run-dir", str(run), env=clean_env(**ONE_SRUN_TASK),
                   check=False, timeout=limit("run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.path is empty: this slurm run would train on the recipe's generated data" in proc.stderr
    assert "data.synthetic=true" in proc.stderr and not run.exists()


def test_data_synthetic_true_trains_on_generated_data_and_the_config_says_so(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", "--recipe", "har", "--epochs", "1", "--run-dir", str(run), "data.synthetic=true",
                   "log.tensorboard=false", env=clean_env(**ONE_SRUN_TASK), timeout=limit("long"))
    assert "training on the recipe's generated data" in proc.stderr
    config = (run / "config.yaml").read_text()
    assert "synthetic: true" in config and config.startswith("# trained on generated data (data.path is empty)\n")
    import yaml
    assert yaml.safe_load(config)["data"]["synthetic"] is True                  # still the config a resume reads


def submit_dry_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "hpc/submit.py", "--recipe", "sasrec", "--nodes", "2", "--gpus-per-node", "4",
                           "--dry-run", *extra], cwd=REPO, env=clean_env(TRAINER_PLUGINS=""), capture_output=True,
                          text=True, timeout=limit("run"))


def test_submit_refuses_generated_data_on_the_cluster_and_its_dry_run_says_what_the_tasks_read(tmp_path):
    refused = submit_dry_run()
    assert refused.returncode == 2 and "error: data.path is empty: this submitit run" in refused.stderr
    asked = submit_dry_run("data.synthetic=true")
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert "# data: generated data (data.path is empty)" in asked.stderr
    real = submit_dry_run(f"data.path={tmp_path}")
    assert real.returncode == 0 and f"# data: data.path={tmp_path}" in real.stderr
    local = subprocess.run([PY, "hpc/submit.py", "--recipe", "sasrec", "--cluster", "local", "--dry-run"], cwd=REPO,
                           env=clean_env(TRAINER_PLUGINS=""), capture_output=True, text=True, timeout=limit("run"))
    assert local.returncode == 0 and "# data: generated data (data.path is empty)" in local.stderr


def test_a_submitted_run_on_generated_data_says_so_and_runs_where_it_is_no_cluster(tmp_path):
    """--cluster debug (this process, no Slurm): generated data is allowed; the submission says what it trains on."""
    proc = subprocess.run([PY, "hpc/submit.py", "--recipe", "har", "--cluster", "debug", "--epochs", "1", "--folder",
                           str(tmp_path / "sub"), "--run-dir", str(tmp_path / "run"), "model.width=8",
                           "data.synthetic_cases=60", "log.tensorboard=false", "--follow"], cwd=REPO,
                          env=clean_env(TRAINER_PLUGINS=""), capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data: generated data (data.path is empty): the tasks train on the recipe's generated data" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "final.pt").exists()

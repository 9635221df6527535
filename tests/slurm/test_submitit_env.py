"""The submitit launcher as submitit really starts tasks: Slurm executor on the local cluster, and the
local executor (no Slurm)."""
import os

import pytest

from tests.conftest import REPO, slurm_env

submitit = pytest.importorskip("submitit", reason="submitit is a declared dependency; `make setup` installs it")


def where() -> dict:
    """Runs inside the task: what the trainer's launcher selection sees."""
    from trainer.distributed.environment import select_environment
    env = select_environment()
    env.validate("ddp")
    return env.describe()


def _run(executor_kind: str, folder, **params) -> list[dict]:
    ex = submitit.AutoExecutor(folder=str(folder), cluster=executor_kind)
    ex.update_parameters(timeout_min=5, **params)
    job = ex.submit(where)
    return sorted(job.results(), key=lambda r: r["rank"])


@pytest.mark.slurm
def test_submitit_slurm_tasks_are_detected(slurm_cluster, tmp_path, monkeypatch):
    for key, value in slurm_env(slurm_cluster).items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(REPO)
    res = _run("slurm", tmp_path / "sub", nodes=2, tasks_per_node=2, slurm_partition="debug")
    assert [r["launcher"] for r in res] == ["submitit"] * 4
    assert [(r["rank"], r["local_rank"], r["node_rank"]) for r in res] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert {r["master_addr"] for r in res} == {"node1"} and len({r["master_port"] for r in res}) == 1


def test_submitit_local_tasks_are_detected(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    res = _run("local", tmp_path / "local", tasks_per_node=2, nodes=1)
    assert [(r["launcher"], r["rank"], r["world_size"]) for r in res] == [("submitit", 0, 2), ("submitit", 1, 2)]
    assert {r["master_addr"] for r in res} == {"127.0.0.1"}

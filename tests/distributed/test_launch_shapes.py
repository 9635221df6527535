"""Launch shapes other than ours, run for real: Kubeflow's PyTorchJob (RANK, WORLD_SIZE, MASTER_*; no LOCAL_RANK),
Lightning's launcher (LOCAL_RANK, NODE_RANK, WORLD_SIZE; no RANK) and `torchrun --virtual-local-rank` (every
worker LOCAL_RANK=0) each train one run with every rank, and the last elects one cache builder per node. (The table
of each shape's facts: tests/unit/test_environment.py; steps smaller than their allocation: tests/slurm/.)"""
from __future__ import annotations

import json
import subprocess

from tests.conftest import PY, REPO, clean_env, free_port, wait_all
from tests.timeouts import limit

TOY = ("train", "--recipe", "toy", "--seed", "5", "--epochs", "1", "log.tensorboard=false", "--batch-size", "16")


def ranks(envs: list[dict], run_dir) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([PY, "-m", "trainer", *TOY, "--run-dir", str(run_dir)], cwd=REPO, env=clean_env(**e),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for e in envs]
    return wait_all(procs, timeout=limit("start"))


def exits(run_dir) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "exits").glob("rank-*.json"))]


def test_kubeflows_shape_trains_one_run_with_every_rank(tmp_path):
    port = str(free_port())
    got = ranks([dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in (0, 1)],
                tmp_path / "run")
    assert [code for code, _ in got] == [0, 0], got[0][1][-3000:]
    assert "recipe=toy world=2" in (tmp_path / "run" / "train.log").read_text()
    assert [e["kind"] for e in exits(tmp_path / "run")] == ["done", "done"]


def test_lightnings_shape_trains_one_run_with_every_rank(tmp_path):
    port = str(free_port())
    got = ranks([dict(LOCAL_RANK=str(r), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                 for r in (0, 1)], tmp_path / "run")
    assert [code for code, _ in got] == [0, 0], got[0][1][-3000:]
    assert "recipe=toy world=2" in (tmp_path / "run" / "train.log").read_text()
    assert [e["kind"] for e in exits(tmp_path / "run")] == ["done", "done"]


def test_a_world_size_without_a_launcher_is_refused_not_a_world_of_one(tmp_path):
    proc = subprocess.run([PY, "-m", "trainer", *TOY, "--run-dir", str(tmp_path / "run")], cwd=REPO,
                          env=clean_env(WORLD_SIZE="2"), text=True, capture_output=True, timeout=limit("run"))
    assert proc.returncode == 2 and "WORLD_SIZE=2 says this process is one of several" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_torchruns_virtual_local_rank_binds_each_worker_and_elects_one_cache_builder(tmp_path):
    data = tmp_path / "u.data"
    data.write_text("".join(f"{u}\t{(3 * u + j) % 50 + 1}\t5\t{100 * u + j}\n" for u in range(1, 41) for j in range(8)))
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--virtual-local-rank", "--master-port",
           str(free_port()), "-m", "trainer", "train", "--recipe", "sasrec", "--epochs", "1", "--batch-size", "8",
           f"data.path={data}", f"data.cache={tmp_path / 'cache'}", "log.tensorboard=false", "model.width=8",
           "dist.timeout_s=20", "--run-dir", str(tmp_path / "run")]     # a wait for keys never set fails fast
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("parsing the data into the cache") == 1             # one builder on this node
    assert [e["kind"] for e in exits(tmp_path / "run")] == ["done", "done"]

"""Real multi-process gloo training on CPU: DDP equivalence, sharded evaluation, accumulation, torchrun."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, assert_close, clean_env, free_port, run_ranks, weights
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out

# plain SGD and no dropout: the comparison is about data and gradient handling, not RNG streams
BASE = ("--recipe", "toy", "--epochs", "1", "--seed", "7", "optim.name=sgd", "optim.lr=0.05",
        "model.dropout=0.0", "train.max_steps=6", "log.tensorboard=false", "ckpt.every_epochs=0")


def test_two_rank_ddp_equals_single_process_on_same_global_batch(tmp_path):
    run_ranks(2, "train", *BASE, "--batch-size", "8", "--run-dir", str(tmp_path / "ddp"))
    cli("train", *BASE, "--batch-size", "16", "--run-dir", str(tmp_path / "single"))
    assert_close(weights(tmp_path / "ddp"), weights(tmp_path / "single"), 1e-6)
    # and it really trained: weights moved away from the initial ones
    init = cli("train", *BASE, "--batch-size", "16", "train.max_steps=0", "--epochs", "0",
                   "--run-dir", str(tmp_path / "init"))
    assert init.returncode == 0
    diff = max((weights(tmp_path / "single")[k] - weights(tmp_path / "init")[k]).abs().max().item()
               for k in weights(tmp_path / "init"))
    assert diff > 1e-3


def test_global_batch_size_with_accumulation_equals_one_big_batch(tmp_path):
    cli("train", *BASE, "--batch-size", "16", "--run-dir", str(tmp_path / "big"))
    cli("train", *BASE, "--global-batch-size", "16", "--grad-accum-steps", "4",
            "--run-dir", str(tmp_path / "accum"))
    run_ranks(2, "train", *BASE, "--global-batch-size", "16", "--grad-accum-steps", "2",
              "--run-dir", str(tmp_path / "ddp_accum"))   # no_sync on the first micro-batch of each window
    big = weights(tmp_path / "big")
    assert_close(weights(tmp_path / "accum"), big, 1e-6)
    assert_close(weights(tmp_path / "ddp_accum"), big, 1e-6)
    log = (tmp_path / "ddp_accum" / "train.log").read_text()
    assert "batch/rank=4 accum=2" in log
    # the timed all-reduce hook (log.measure_sync) averages gradients as DDP's own does
    run_ranks(2, "train", *BASE, "--global-batch-size", "16", "--grad-accum-steps", "2", "log.measure_sync=true",
              "log.every_steps=1", "--run-dir", str(tmp_path / "ddp_timed"))
    assert_close(weights(tmp_path / "ddp_timed"), big, 1e-6)
    rows = read_metrics(tmp_path / "ddp_timed")
    waits = [r["sync_wait_frac"] for r in rows if "step_time_s" in r]
    assert len(waits) == 6 and all(0 <= w <= 1 for w in waits) and max(waits) > 0
    assert not any("sync_wait_frac" in r for r in read_metrics(tmp_path / "ddp_accum"))


def test_sharded_evaluation_equals_single_process(tmp_path):
    cli("train", *BASE, "--batch-size", "16", "--run-dir", str(tmp_path / "run"))
    ckpt = str(tmp_path / "run" / "checkpoints" / "final.pt")
    cli("eval", "--checkpoint", ckpt, "--out", str(tmp_path / "one.json"), "train.batch_size=5")
    run_ranks(3, "eval", "--checkpoint", ckpt, "--out", str(tmp_path / "three.json"), "train.batch_size=5")
    one, three = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "three.json"))
    for split, n in (("val", 61), ("test", 37)):           # 61 and 37 samples: uneven shards over 3 ranks
        assert one[split]["count"] == three[split]["count"] == n
        # float32 forward passes batch samples differently per shard: agreement at float32 precision
        assert abs(one[split]["mse"] - three[split]["mse"]) <= 1e-6 * one[split]["mse"]
    # the value logged by the training run agrees with the stand-alone evaluation
    rows = read_metrics(tmp_path / "run")
    test_row = [r for r in rows if r["split"] == "test" and r["checkpoint"] == "final"][-1]
    assert abs(test_row["mse"] - one["test"]["mse"]) <= 1e-6 * one["test"]["mse"]


def test_torchrun_launch_and_logged_artifacts(tmp_path):
    run_dir = tmp_path / "tr"
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "trainer", "train", *BASE, "--batch-size", "8", "--run-dir", str(run_dir),
           "train.max_steps=0", "--epochs", "2", "log.every_steps=2", "log.tensorboard=true"]
    env = clean_env()
    proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=limit("start"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert {r["split"] for r in rows} == {"train", "val", "test"}
    train_rows = [r for r in rows if r["split"] == "train" and "loss" in r]
    assert train_rows and all({"epoch", "step", "samples_per_s", "step_time_s", "lr", "rss_mb"} <= set(r)
                              for r in train_rows)
    assert all(r["step"] % 2 == 0 for r in train_rows)
    assert (run_dir / "config.yaml").exists() and list((run_dir / "tb").iterdir())
    log = (run_dir / "train.log").read_text()
    assert "world=2" in log and "[rank 0]" in log and "[rank 1]" not in log  # only rank 0 writes the log

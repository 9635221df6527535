"""HAR end to end: 2-rank DDP on BasicMotions (synthetic stand-in without ../shared) beats chance widely,
sharded evaluation equals single-process, --strategy dp falls back on CPU, bitwise resume mid-epoch,
train.deterministic's refusal of an op without a deterministic kernel."""
import json
import subprocess

import numpy as np
import pytest
import torch

from tests.conftest import (
    PY,
    REPO,
    assert_bitwise_equal,
    clean_env,
    eval_one_and_three,
    run_ranks,
    train_until_sigterm,
    weights,
)
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.recipes.har import data as hd

BASIC = REPO.parent / "shared" / "data" / "BasicMotions"
FAST = ("--recipe", "har", "log.tensorboard=false", "model.width=16", "model.channel_width=16", "model.head_width=32")


@pytest.fixture(scope="module")
def basic(tmp_path_factory):
    """BasicMotions, or a synthetic stand-in of the same shape (40/40 cases, 6 channels x 100, 4 classes)."""
    if BASIC.exists():
        return BASIC
    print(f"{BASIC} missing: using a synthetic 40/40 x 6 x 100 dataset in its place")
    root = tmp_path_factory.mktemp("basic")
    s = hd.synthesize(n=80, channels=6, length=100, classes=4, seed=0)    # one draw: the class patterns are
    x, y = np.stack(s.samples), s.labels                                   # the seed's, so both splits share them
    for split, part in (("train", slice(0, 40)), ("test", slice(40, 80))):
        np.savez(root / f"{split}.npz", samples=x[part], labels=y[part])
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, basic):
    run_dir = tmp_path_factory.mktemp("har")
    run_ranks(2, "train", *FAST, "--epochs", "25", "--batch-size", "8", "--run-dir", str(run_dir),
              f"data.path={basic}", timeout=limit("long"))
    return run_dir


def test_two_rank_ddp_beats_chance_by_a_wide_margin(trained):
    test = read_metrics(trained, "test")
    assert test and all(r["cases"] == 40 for r in test)
    assert test[-1]["accuracy"] >= 0.75, test          # chance: 0.25 (4 balanced classes)
    cm = np.array(test[-1]["confusion_matrix"])
    assert cm.shape == (4, 4) and cm.sum() == 40 and np.trace(cm) == round(test[-1]["accuracy"] * 40)
    assert len([k for k in test[-1] if k.startswith("f1/")]) == 4 and 0 <= test[-1]["macro_f1"] <= 1
    assert (trained / "confusion_val.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (trained / "confusion_test.png").exists()
    ckpt = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)
    val = read_metrics(trained, "val")
    assert ckpt["state"]["best"] == max(r["macro_f1"] for r in val)
    train = [r for r in read_metrics(trained, "train") if "samples_per_s" in r]
    assert train and all(r["samples_per_s"] > 0 for r in train)
    # the seeds log training accuracy: one record per epoch, over both ranks' batches
    epochs = [r for r in read_metrics(trained, "train") if "accuracy" in r]
    assert len(epochs) == len(val) and all(0 <= r["accuracy"] <= 1 for r in epochs)
    assert epochs[-1]["accuracy"] > 0.25                 # chance, on batches trained with dropout


def test_sharded_evaluation_equals_single_process(trained, tmp_path):
    one, three = eval_one_and_three(trained / "checkpoints" / "final.pt", tmp_path, "train.eval_batch_size=7")
    for split in ("val", "test"):
        assert one[split]["cases"] == three[split]["cases"] > 0
        assert one[split]["confusion_matrix"] == three[split]["confusion_matrix"]
        for key, value in one[split].items():
            if isinstance(value, float):
                assert three[split][key] == pytest.approx(value, abs=1e-6), key   # loss: batch-size-dependent kernels
    # the 2-rank run scored both shards with rank 0's BatchNorm statistics (sent before evaluating, not before
    # every step), which final.pt holds: its logged test metrics are the single-process ones
    logged = [r for r in read_metrics(trained, "test") if r.get("checkpoint") == "final"][-1]
    assert logged["confusion_matrix"] == one["test"]["confusion_matrix"]
    assert logged["loss"] == pytest.approx(one["test"]["loss"], abs=1e-6)


def test_dp_without_cuda_falls_back_to_one_device_with_a_warning(tmp_path):
    proc = cli("train", *FAST, "--epochs", "1", "--strategy", "dp", "--gpu-ids", "0,1", "--mode", "average",
                   "--run-dir", str(tmp_path))
    assert "--strategy dp needs two or more CUDA devices (no CUDA here): using one device (cpu)" in proc.stderr
    assert read_metrics(tmp_path, "test")[-1]["cases"] > 0
    assert "mode: average" in (tmp_path / "config.yaml").read_text()


def test_resume_mid_epoch_is_bitwise_exact(tmp_path):
    args = ("train", *FAST, "--epochs", "2", "--batch-size", "32", "ckpt.every_epochs=1", "--grad-accum-steps", "2")
    cli(*args, "--run-dir", str(tmp_path / "ref"))
    kill_at = 13                       # micro-batch 13 of 2 x 9: inside epoch 1, between optimizer steps
    proc = train_until_sigterm("trainer.recipes.har.recipe", "HARRecipe", kill_at, args, tmp_path / "run")
    assert proc.returncode == 143 and "checkpointing at epoch 1" in proc.stderr, proc.stderr[-2000:]
    cli(*args, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))
    a, b = (read_metrics(p, "test")[-1] for p in (tmp_path / "run", tmp_path / "ref"))
    assert a["confusion_matrix"] == b["confusion_matrix"] and a["loss"] == b["loss"]


def test_deterministic_kernels_stop_an_op_without_one_as_a_usage_error(tmp_path):
    """train.deterministic=true: an op with no deterministic kernel (put_ here, MaxPool3d's CUDA backward on a
    GPU) stops the run with exit 2 (never relaunched), naming the op and the way out; without it, it trains."""
    code = ("import sys,torch,trainer.recipes.har.recipe as r;orig=r.HARRecipe.training_step\n"
            "def step(self,m,b):\n torch.zeros(3).put_(torch.tensor([0]),torch.ones(1))\n return orig(self,m,b)\n"
            "r.HARRecipe.training_step=step\nfrom trainer.cli import main;sys.exit(main(sys.argv[1:]))")
    args = [PY, "-c", code, "train", *FAST, "--epochs", "1"]
    proc = subprocess.run([*args, "train.deterministic=true", "--run-dir", str(tmp_path / "det")], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: train.deterministic=true: put_ does not have a deterministic implementation" in proc.stderr
    assert "HINT: train.deterministic=false" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "det" / "exits" / "rank-0.json").read_text())["kind"] == "usage"
    proc = subprocess.run([*args, "--run-dir", str(tmp_path / "free")], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-3000:]

"""On a CUDA device (marked gpu; skipped, with the reason printed, where torch sees none): every recipe's
GPU-shaped step under torch.cuda.set_sync_debug_mode("error"), AMP bf16/fp16, compile.mode with CUDA-graph
replay, checkpoints between CUDA and the CPU, and a world-1 NCCL group under torchrun."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.opcount import endless, epoch_loop_for
from tests.conftest import REPO, clean_env, free_port, trainer
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available() is False): the GPU "
    "tests run on a GPU node, e.g. `python -m pytest -m gpu tests/gpu` on the device machine")]

SMALL = {"sasrec": ["data.maxlen=50", "train.batch_size=32"], "har": [], "kgat": [],
         "video": ["model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4",
                   "data.synthetic_frames=30", "train.num_workers=0", "train.batch_size=4"]}
VARIANTS = [("sasrec", ["model.time=false", "model.mhc=false"]), ("sasrec", ["model.time=true", "model.mhc=false"]),
            ("sasrec", []), ("har", []), ("kgat", []), ("video", [])]
# issue 71's losses and the Beauty config's model (the CPU's op counter checks them too: tests/recipes/test_gpu_path.py)
PLAIN = ["model.time=false", "model.mhc=false"]
LOSSES = [PLAIN + ["loss.kind=ce"], PLAIN + ["loss.kind=gbce", "data.train_negatives=16"],
          PLAIN + ["loss.kind=sampled_softmax", "loss.shared_negatives=sequence",
                   "loss.negative_distribution=popularity", "data.train_negatives=64"],
          PLAIN + ["loss.shared_negatives=batch", "data.train_negatives=64"],
          PLAIN + ["loss.kind=gbce", "loss.shared_negatives=in_batch"],
          PLAIN + ["model.norm=original", "model.positions=from_start", "model.init=normal"]]
LOSS_NAMES = ["ce", "gbce", "popularity-logq", "batch-shared", "in-batch", "beauty-model"]


@pytest.mark.parametrize("recipe,extra", VARIANTS + [("sasrec", losses) for losses in LOSSES],
                         ids=[r for r, _ in VARIANTS] + [f"issue71-{n}" for n in LOSS_NAMES])
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_steps_never_sync_with_the_host(recipe, extra, amp):
    tr, _ = epoch_loop_for(recipe, SMALL[recipe] + extra + [f"train.amp={amp}"], "cuda:0")
    assert tr.run.recipe.gpu_shaped                       # auto: the GPU path on a CUDA device
    batches = endless(tr)                                 # HAR's small epoch holds fewer than 6 batches
    for _ in range(3):                                    # the first steps make the optimizer's state
        tr.step(*next(batches))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            tr.step(*next(batches))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tr.losses.read()


@pytest.mark.parametrize("mode,loss", [("default", "bce"), ("reduce-overhead", "bce"), ("reduce-overhead", "ce")],
                         ids=["default", "reduce-overhead", "issue71-reduce-overhead-ce"])
def test_compiled_training_with_cuda_graphs(tmp_path, mode, loss):
    run = tmp_path / mode
    trainer("train", "--recipe", "sasrec", *SMALL["sasrec"], "model.time=false", "model.mhc=false", "--epochs", "2",
            f"compile.mode={mode}", "--amp", "bf16", "--run-dir", str(run), "log.tensorboard=false",
            f"loss.kind={loss}", timeout=limit("jobs"))
    test = read_metrics(run, "test")
    assert test and test[0]["ndcg@10"] > 0.05


def test_a_cuda_checkpoint_evaluates_on_the_cpu_and_a_cpu_one_resumes_on_cuda(tmp_path):
    trainer("train", "--recipe", "har", "--epochs", "1", "--run-dir", str(tmp_path / "gpu"), timeout=limit("long"))
    cpu = clean_env(CUDA_VISIBLE_DEVICES="")
    trainer("eval", "--checkpoint", str(tmp_path / "gpu" / "checkpoints" / "final.pt"), env=cpu)
    trainer("train", "--recipe", "har", "--epochs", "1", "--run-dir", str(tmp_path / "cpu"), env=cpu)
    trainer("train", "--recipe", "har", "--epochs", "2", "--run-dir", str(tmp_path / "cpu"), "--resume", "auto")


def test_world_one_nccl_under_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           f"--master-port={free_port()}", "-m", "trainer", "train", "--recipe", "har", "--epochs",
                           "1", "--run-dir", str(tmp_path / "run")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-3000:]

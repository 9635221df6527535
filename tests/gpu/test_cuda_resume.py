"""Issue 54 steps 3 and 4 on a CUDA device (marked gpu): two DDP ranks sharing the one GPU over gloo train and
resume, and a run stopped by SIGTERM and resumed ends bitwise equal to an uninterrupted one under
train.deterministic=true, for every recipe.

Two ranks on one GPU stand in for a multi-GPU NCCL run, which a one-GPU machine cannot host (NCCL refuses two
ranks on one device): the device placement, the binding, the sampler, the agreements and the checkpoints are
the same; the all-reduce is gloo's over CUDA tensors (through the host) instead of NCCL's.

Where torch sees no CUDA device the tests are skipped with the reason printed, unless GPU_CHECK_ON_CPU=1: then
they run on the CPU with the GPU-shaped step (train.gpu_path=on), to check bench/gpu_check.sh's plumbing
before a GPU's time is spent on it.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.conftest import (
    PY,
    assert_bitwise_equal,
    clean_env,
    free_port,
    run_group,
    train_until_sigterm,
    trainer,
    weights,
)
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

ON_CPU = os.environ.get("GPU_CHECK_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU),
    reason="no CUDA device here (torch.cuda.is_available() is False): run on a GPU node "
           "(bench/gpu_check.sh), or GPU_CHECK_ON_CPU=1 for a plumbing check on the CPU")]
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
PLACE = [] if torch.cuda.is_available() else ["train.gpu_path=on"]

SMALL = {
    "sasrec": ["--recipe", "sasrec", "data.synthetic_users=300", "data.synthetic_items=120",
               "data.synthetic_mean_len=25", "data.maxlen=24", "model.width=32", "model.heads=2",
               "--batch-size", "32"],
    "har": ["--recipe", "har", "model.width=16", "model.channel_width=16", "model.head_width=32", "--batch-size", "8"],
    "kgat": ["--recipe", "kgat", "--batch-size", "128"],
    "video": ["--recipe", "video", "model.arch=light", "data.size=32", "data.clip_len=9", "data.synthetic_videos=4",
              "data.synthetic_frames=30", "train.num_workers=0", "--batch-size", "4"],
}
CLASSES = {"sasrec": ("trainer.recipes.sasrec.recipe", "SASRecRecipe"),
           "har": ("trainer.recipes.har.recipe", "HARRecipe"),
           "kgat": ("trainer.recipes.kgat.recipe", "KGATRecipe"),
           "video": ("trainer.recipes.video.recipe", "VideoRecipe")}
COMMON = ["--seed", "5", "log.tensorboard=false", "train.eval_every_epochs=5", "ckpt.every_epochs=1",
          "train.deterministic=true", *PLACE]


def _torchrun(run_dir, *args: str) -> None:
    code, err = run_group([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
                           "-m", "trainer", "train", *args, "--run-dir", str(run_dir)], clean_env(),
                          timeout=limit("start"))
    assert code == 0, err[-4000:]


def test_two_ranks_share_the_gpu_over_gloo_train_and_resume(tmp_path):
    # a constant schedule: one epoch then a resume to two is then the same run as two epochs at once
    args = [*SMALL["sasrec"], *COMMON, "dist.backend=gloo", "log.per_rank=true", "optim.schedule=constant"]
    _torchrun(tmp_path / "ref", *args, "--epochs", "2")
    _torchrun(tmp_path / "run", *args, "--epochs", "1")
    _torchrun(tmp_path / "run", *args, "--epochs", "2", "--resume", "auto")
    logs = [(tmp_path / "run" / f"train.rank{r}.log").read_text() for r in (0, 1)]
    for log in logs:                                   # both ranks on the one device, a world of two
        assert re.search(rf"world=2 device={DEVICE}\b", log), log[-2000:]
    assert "resumed from" in logs[0] and "step" in logs[0]
    test = read_metrics(tmp_path / "run", "test")
    assert test and 0 < test[-1]["ndcg@10"] <= 1
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))


def _steps_per_epoch(run_dir) -> int:
    """The optimizer steps of the first epoch: the step of the first epoch-end checkpoint."""
    steps = sorted(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert steps, f"no periodic checkpoint in {run_dir}"
    return steps[0]


@pytest.mark.parametrize("recipe", list(SMALL))
def test_resume_after_sigterm_is_bitwise_with_deterministic_kernels(tmp_path, recipe):
    args = ("train", *SMALL[recipe], *COMMON, "--epochs", "2")
    trainer(*args, "--run-dir", str(tmp_path / "ref"), timeout=limit("long"))
    per_epoch = _steps_per_epoch(tmp_path / "ref")
    kill_at = per_epoch + max(per_epoch // 2, 1)       # inside epoch 1 (one micro-batch per optimizer step)
    proc = train_until_sigterm(*CLASSES[recipe], kill_at, args, tmp_path / "run")
    assert proc.returncode == 143 and "checkpointing at epoch 1" in proc.stderr, proc.stderr[-3000:]
    trainer(*args, "--run-dir", str(tmp_path / "run"), "--resume", "auto", timeout=limit("long"))
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))


def _overrides(args: list[str]) -> tuple[str, list[str]]:
    """SMALL's command-line words as (recipe, key=value overrides) for an in-process EpochLoop."""
    words, recipe, out = iter(args), "", []
    for w in words:
        if w == "--recipe":
            recipe = next(words)
        elif w == "--batch-size":
            out.append(f"train.batch_size={next(words)}")
        else:
            out.append(w)
    return recipe, out


def _two_epochs(recipe: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    """The weights after two epochs of an in-process EpochLoop, epoch ends (KGAT's attention) included."""
    from bench.opcount import epoch_loop_for
    tr, _ = epoch_loop_for(recipe, overrides, DEVICE)
    for epoch in range(2):
        tr.run.recipe.on_epoch_start(epoch, tr.run.model)
        for micro, batch in enumerate(tr.batches(epoch, 0)):
            tr.step(batch, micro)
        tr.losses.read()
        tr.run.recipe.on_epoch_end(epoch, tr.run.model)
    return {k: v.detach().clone() for k, v in tr.run.model.state_dict().items()}


@pytest.mark.parametrize("case", ["sasrec", "har", "kgat", "kgat-dense", "video"])
def test_two_runs_give_the_same_bits_under_deterministic_kernels(case):
    """What the resume test needs first: the same run twice, uninterrupted, gives the same weights (a
    nondeterministic kernel fails here, a resume's own defect only there)."""
    recipe, overrides = _overrides(SMALL[case.split("-")[0]])
    overrides += ["seed=5", "train.deterministic=true", *PLACE] + (["model.kg_update=dense"] if "dense" in case else [])
    try:
        first, second = _two_epochs(recipe, overrides), _two_epochs(recipe, overrides)
    finally:
        torch.use_deterministic_algorithms(False)
    assert_bitwise_equal(first, second)

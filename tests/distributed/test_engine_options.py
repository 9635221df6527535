"""Engine options end to end: AMP, clipping, DataParallel fallback, progress bar, strategy errors,
evaluation with more ranks than samples."""

import signal

import pytest
import torch

from tests.conftest import launch_ranks, run_ranks, trainer, wait_all, weights
from tests.inprocess import cli
from trainer.engine.logging import read_metrics

QUICK = ("--recipe", "toy", "--epochs", "1", "--seed", "1", "log.tensorboard=false", "ckpt.every_epochs=0")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_modes_train_and_save_scaler_state(tmp_path, amp):
    proc = cli("train", *QUICK, "--amp", amp, "--run-dir", str(tmp_path))
    assert proc.returncode == 0
    ckpt = torch.load(tmp_path / "checkpoints" / "final.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())   # master weights stay fp32
    if amp == "fp16":
        assert ckpt["scaler"]["scale"] > 0                                  # GradScaler in use
    else:
        assert ckpt["scaler"] == {}                                         # bf16 needs no scaler
    val = read_metrics(tmp_path)
    assert all(r["mse"] == r["mse"] for r in val if r["split"] == "val")    # finite, not NaN


def test_clipping_limits_the_update(tmp_path):
    common = (*QUICK, "optim.name=sgd", "optim.lr=0.5", "model.dropout=0.0", "train.max_steps=1")
    cli("train", *common, "train.max_steps=0", "--epochs", "0", "--run-dir", str(tmp_path / "init"))
    cli("train", *common, "--run-dir", str(tmp_path / "free"))
    cli("train", *common, "optim.clip_grad_norm=0.001", "--run-dir", str(tmp_path / "clip"))
    init = weights(tmp_path / "init")

    def step_norm(name):
        w = weights(tmp_path / name)
        return sum(((w[k] - init[k]) ** 2).sum() for k in w).sqrt().item()
    # one SGD step moves the weights by lr x |grad|: clipping bounds it by lr x 0.001
    assert step_norm("clip") <= 0.5 * 0.001 * 1.0001 < step_norm("free")


def test_dp_without_gpus_falls_back_with_warning(tmp_path):
    proc = cli("train", *QUICK, "--strategy", "dp", "--gpu-ids", "0,1", "--run-dir", str(tmp_path))
    assert "--strategy dp needs two or more CUDA devices" in proc.stderr
    assert (tmp_path / "checkpoints" / "final.pt").exists()


def test_single_strategy_with_several_ranks_is_refused(tmp_path):
    results = wait_all(launch_ranks(2, "train", *QUICK, "--strategy", "single", "--run-dir", str(tmp_path)))
    assert all(code == 2 for code, _ in results)
    assert "HINT: use --strategy ddp" in results[0][1]


def test_progress_bar_on_rank_zero(tmp_path):
    proc = cli("train", *QUICK, "log.progress=on", "--run-dir", str(tmp_path))
    assert "epoch 0" in proc.stderr and "batch/s" in proc.stderr or "s/batch" in proc.stderr


def test_evaluation_with_more_ranks_than_samples(tmp_path):
    """Rank 2 has an empty validation shard (2 samples, 3 ranks): it still joins the reduction."""
    run_ranks(3, "train", *QUICK, "data.n_val=2", "data.n_test=1", "--run-dir", str(tmp_path))
    rows = read_metrics(tmp_path)
    assert [r["count"] for r in rows if r["split"] == "val"] == [2]
    assert [(r["count"], r["checkpoint"]) for r in rows if r["split"] == "test"] == [(1, "final"), (1, "best")]


def test_a_requeue_signal_named_in_the_config_is_trapped_and_checkpointed(tmp_path):
    """Issue 19.3: ckpt.requeue_signals may name any catchable signal (SIGURG is ignored by default: without
    the trap the run would go on to the end)."""
    run = ("train", "--recipe", "toy", "--epochs", "2", "--run-dir", str(tmp_path), "log.tensorboard=false",
           "ckpt.requeue_signals=[SIGUSR1,SIGURG]", "data.signal_at_step=3", "data.signal_name=SIGURG")
    proc = trainer(*run, check=False)
    assert proc.returncode == 128 + signal.SIGURG, proc.stderr[-2000:]
    assert "received SIGURG: checkpointing at epoch 0 step 3" in proc.stderr
    assert (tmp_path / "checkpoints" / "step-00000003.pt").exists()
    bad = cli("train", "--recipe", "toy", "--run-dir", str(tmp_path / "bad"), "ckpt.requeue_signals=[SIGKILL]",
                  check=False)
    assert bad.returncode == 2 and "'SIGKILL' is not a signal this process can catch" in bad.stderr


def tb_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_does_not_show_replayed_steps_twice_after_a_resume(tmp_path):
    """Issue 19.8: a crash (SIGKILL) at step 6 after a checkpoint at step 3; the resumed run replays 4 and 5.
    TensorBoard's purge_step drops the first attempt's 4 and 5 (without it they appear twice)."""
    run = ("train", "--recipe", "toy", "--epochs", "1", "--run-dir", str(tmp_path), "log.every_steps=1",
           "ckpt.every_steps=3", "ckpt.every_epochs=0")
    first = trainer(*run, "data.signal_at_step=6", "data.signal_name=SIGKILL", check=False)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    trainer(*run, "--resume", "auto")            # a process of its own, as a requeue is (its events file)
    steps = [e.step for e in tb_events(tmp_path).Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[:6] == [1, 2, 3, 4, 5, 6], steps
    jsonl = [r["step"] for r in read_metrics(tmp_path, "train") if "loss" in r]
    assert jsonl.count(4) == 2 and jsonl.count(3) == 1   # metrics.jsonl keeps both attempts (it is a log)


def test_confusion_matrices_also_go_to_tensorboard_as_images(tmp_path):
    """Issue 19.8: the classifier recipes' PNGs appear under <split>/confusion_<split>."""
    cli("train", "--recipe", "har", "--epochs", "1", "--run-dir", str(tmp_path), "data.synthetic_cases=120",
            "model.width=8", "model.channel_width=8", "model.head_width=8")
    tags = tb_events(tmp_path).Tags()["images"]
    assert {"val/confusion_val", "test/confusion_test"} <= set(tags), tags

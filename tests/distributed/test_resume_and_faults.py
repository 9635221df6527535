"""Preemption and resume (bitwise equality with an uninterrupted run), dead and hung ranks. The runs a signal reaches
are processes; the reference and the refusals run in this process (tests/inprocess.py)."""
import signal
import time

import pytest

from tests.conftest import assert_bitwise_equal, launch_ranks, record_fault, run_ranks, trainer, wait_all, weights
from tests.inprocess import cli

# 256 samples / batch 32 = 8 steps per epoch; dropout on, so RNG restore matters
RUN = ("--recipe", "toy", "--epochs", "3", "--seed", "3", "log.tensorboard=false", "ckpt.every_epochs=1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    cli("train", *RUN, "--run-dir", str(run_dir))
    return weights(run_dir)


@pytest.mark.parametrize("step,where", [(8, "epoch boundary"), (11, "mid-epoch"), (3, "before any checkpoint")])
def test_sigterm_then_resume_is_bitwise_equal(tmp_path, reference, step, where):
    run_dir = str(tmp_path / "run")
    first = trainer("train", *RUN, "--run-dir", run_dir, f"data.signal_at_step={step}", check=False)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-2000:]
    epoch, batch = (step - 1) // 8, step - 8 * ((step - 1) // 8)   # step 8 is the last batch of epoch 0
    assert f"received SIGTERM: checkpointing at epoch {epoch} step {step}" in first.stderr
    assert not (tmp_path / "run" / "checkpoints" / "final.pt").exists()
    second = trainer("train", *RUN, "--run-dir", run_dir, "--resume", "auto")
    assert f"resumed from {run_dir}/checkpoints/step-{step:08d}.pt: epoch {epoch}, batch {batch}" \
        in second.stderr
    assert_bitwise_equal(weights(tmp_path / "run"), reference)
    record_fault(f"SIGTERM {where} (1 process)", steps_lost=0, outcome="checkpoint at the signal's step, exit 143, "
                 "bitwise resume")


def test_two_ranks_agree_on_one_ranks_signal_and_resume_bitwise(tmp_path):
    """Only rank 1 gets SIGUSR1 mid-epoch; both ranks stop at the same step, checkpoint, and resume."""
    args = ("train", *RUN, "--batch-size", "16")
    run_ranks(2, *args, "--run-dir", str(tmp_path / "ref"))
    results = wait_all(launch_ranks(2, *args, "--run-dir", str(tmp_path / "run"), "data.signal_at_step=5",
                                    "data.signal_name=SIGUSR1", "data.signal_rank=1"))
    assert [code for code, _ in results] == [128 + signal.SIGUSR1] * 2, results[0][1][-2000:]
    assert "received SIGUSR1: checkpointing at epoch 0 step 5" in results[0][1]
    resumed = run_ranks(2, *args, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert "batch 5, step 5" in resumed[0][1]
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))


def test_truncated_newest_checkpoint_is_skipped_on_resume(tmp_path, reference):
    run_dir = tmp_path / "run"
    trainer("train", *RUN, "--run-dir", str(run_dir), "data.signal_at_step=11", "ckpt.keep_last=5",
            check=False)
    newest = run_dir / "checkpoints" / "step-00000011.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    second = trainer("train", *RUN, "--run-dir", str(run_dir), "--resume", "auto")
    assert "skipping checkpoint" in second.stderr and "step-00000011.pt is truncated" in second.stderr
    assert "resumed from" in second.stderr and "step-00000008.pt" in second.stderr
    assert (run_dir / "checkpoints" / "step-00000011.pt.corrupt").exists()      # kept for inspection
    assert_bitwise_equal(weights(run_dir), reference)
    record_fault("newest checkpoint truncated (node died mid-copy)", steps_lost=11 - 8,
                 outcome="moved aside as `*.corrupt`, resumed from the previous one, bitwise equal at the end")


def test_foreign_or_misshaped_checkpoint_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    cli("train", *RUN, "--epochs", "1", "--run-dir", str(run_dir))
    other = cli("train", *RUN, "--run-dir", str(tmp_path / "b"), "model.hidden=32",
                "--resume", str(run_dir / "checkpoints" / "final.pt"), check=False)
    assert other.returncode == 2 and "model.hidden 16 -> 32 would change what this run is" in other.stderr
    assert not (tmp_path / "b" / "config.yaml").exists()         # refused before anything is written
    weights_only = cli("train", *RUN, "--run-dir", str(tmp_path / "c"), "model.hidden=32",
                       "--init-from", str(run_dir / "checkpoints" / "final.pt"), check=False)
    assert weights_only.returncode == 2 and "does not fit this model" in weights_only.stderr
    assert "net.0.weight: checkpoint (16, 8) vs model (32, 8)" in weights_only.stderr


def test_resume_of_completed_run_does_no_more_work(tmp_path):
    run_dir = tmp_path / "run"
    cli("train", *RUN, "--epochs", "1", "--run-dir", str(run_dir))
    again = cli("train", *RUN, "--epochs", "1", "--run-dir", str(run_dir), "--resume", "auto")
    assert "resumed from" in again.stderr and "final.pt" in again.stderr
    assert "training completed after 8 steps" in again.stderr


@pytest.mark.timing
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_rank_makes_the_other_exit_nonzero(tmp_path, how):
    """A killed rank breaks the connection; a frozen one trips the process-group timeout. No hang."""
    timeout_s = 8
    procs = launch_ranks(2, "train", *RUN, "--epochs", "50", "--run-dir", str(tmp_path / "run"),
                         f"dist.timeout_s={timeout_s}", "data.step_sleep=0.02", "data.signal_at_step=20",
                         f"data.signal_name={how}", "data.signal_rank=1")
    t0 = time.monotonic()
    try:
        rc0 = procs[0].wait(timeout=timeout_s + 90)
    finally:
        for p in procs:
            if p.poll() is None or how == "SIGSTOP":
                p.kill()
        for p in procs:
            p.wait()
    elapsed = time.monotonic() - t0
    record_fault(f"{how} of one rank of 2 (dist.timeout_s={timeout_s})", exit_s=round(elapsed, 1),
                 outcome="the other rank exits non-zero (time from launch; the fault comes at step 20)")
    assert rc0 != 0, "rank 0 should fail when its peer is gone"
    assert elapsed < timeout_s + 90


def test_a_format_1_checkpoint_mid_epoch_resumes_at_its_batch_bitwise(tmp_path, reference):
    """A checkpoint of the previous format (no sample position or layout in its state) resumes where its batch
    count says, converted to samples: the run ends bitwise equal to an uninterrupted one."""
    import torch
    run_dir = tmp_path / "run"
    trainer("train", *RUN, "--run-dir", str(run_dir), "data.signal_at_step=11", check=False)
    path = run_dir / "checkpoints" / "step-00000011.pt"
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["format"] == 2 and ckpt["state"]["sample_in_epoch"] == 3 * 32
    ckpt["format"] = 1
    for key in ("sample_in_epoch", "batches_in_epoch", "layout"):
        del ckpt["state"][key]
    torch.save(ckpt, path)
    second = trainer("train", *RUN, "--run-dir", str(run_dir), "--resume", "auto")
    assert "epoch 1, batch 3, step 11" in second.stderr
    assert_bitwise_equal(weights(run_dir), reference)

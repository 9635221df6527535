"""Video end to end on synthetic H.264 videos: 2-rank DDP (with loader workers reading the memmaps) beats
chance clearly, sharded evaluation equals single-process, bitwise resume mid-epoch, the class-weight table."""
import numpy as np
import pytest
import torch

from tests.conftest import assert_bitwise_equal, eval_one_and_three, run_ranks, train_until_sigterm, weights
from tests.inprocess import cli
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.recipes.video.data import synth_videos

FAST = ("--recipe", "video", "log.tensorboard=false", "model.arch=light", "data.size=32", "data.clip_len=9",
        "--lr", "0.003", "ckpt.every_epochs=0")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return synth_videos(tmp_path_factory.mktemp("videos"), videos=6, frames=60, size=32, classes=3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, videos):
    run_dir = tmp_path_factory.mktemp("video")
    results = run_ranks(2, "train", *FAST, "--epochs", "6", "--batch-size", "8", "train.num_workers=1",
                        f"data.path={videos}", "--run-dir", str(run_dir), timeout=limit("job"))
    return run_dir, results


def test_two_rank_ddp_beats_chance_clearly(trained):
    run_dir, _ = trained
    test = read_metrics(run_dir, "test")
    assert test and test[-1]["cases"] == 60                       # one test video of 60 labelled frames
    assert test[-1]["accuracy"] >= 0.6, test[-1]                   # chance: 1/3
    cm = np.array(test[-1]["confusion_matrix"])
    assert cm.shape == (3, 3) and cm.sum() == 60
    assert (run_dir / "confusion_test.png").exists() and (run_dir / "confusion_val.png").exists()
    log = (run_dir / "train.log").read_text()
    assert "Class Distribution and Weights" in log and "world=2" in log
    train = [r for r in read_metrics(run_dir, "train") if "accuracy" in r]     # the seed's train accuracy
    assert train and all(0 <= r["accuracy"] <= 1 for r in train)
    # the model trained channels-last on the CPU (the saved weights keep the layout)
    state = torch.load(run_dir / "checkpoints" / "final.pt", map_location="cpu", weights_only=True)["model"]
    convs = [v for k, v in state.items() if k.endswith(".0.weight") and v.dim() == 5]
    assert convs and all(v.is_contiguous(memory_format=torch.channels_last_3d) for v in convs[1:])


def test_sharded_evaluation_equals_single_process(trained, tmp_path):
    run_dir, _ = trained
    one, three = eval_one_and_three(run_dir / "checkpoints" / "final.pt", tmp_path, "train.eval_batch_size=7",
                                    "train.num_workers=0")
    for split in ("val", "test"):
        assert one[split]["cases"] == three[split]["cases"] > 0
        assert one[split]["confusion_matrix"] == three[split]["confusion_matrix"]
        assert three[split]["loss"] == pytest.approx(one[split]["loss"], abs=1e-6)


def test_resume_mid_epoch_is_bitwise_exact(tmp_path, videos):
    args = ("train", *FAST, "--epochs", "2", "--batch-size", "16", "train.num_workers=0", f"data.path={videos}")
    cli(*args, "--run-dir", str(tmp_path / "ref"))
    kill_at = 20                       # epoch 0 has 15 batches of 16 (240 training clips): inside epoch 1
    proc = train_until_sigterm("trainer.recipes.video.recipe", "VideoRecipe", kill_at, args, tmp_path / "run")
    assert proc.returncode == 143 and "checkpointing at epoch 1" in proc.stderr, proc.stderr[-2000:]
    cli(*args, "--run-dir", str(tmp_path / "run"), "--resume", "auto")
    assert_bitwise_equal(weights(tmp_path / "run"), weights(tmp_path / "ref"))


def test_a_corrupt_video_stops_every_rank_with_its_name(tmp_path, videos):
    import shutil

    from tests.conftest import launch_ranks, wait_all
    data = tmp_path / "data"
    shutil.copytree(videos, data, ignore=shutil.ignore_patterns(".frame-cache"))
    (data / "synth03.mp4").write_bytes(b"not a video" * 100)
    results = wait_all(launch_ranks(2, "train", *FAST, "--epochs", "1", f"data.path={data}",
                                    "--run-dir", str(tmp_path / "run")), timeout=limit("run"))
    for code, err in results:             # rank 1 learns rank 0's error instead of waiting for a timeout
        assert code != 0 and "synth03.mp4: unreadable or corrupt video" in err, err[-2000:]

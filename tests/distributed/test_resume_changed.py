"""A resume under changed conditions: 2 -> 1 -> 3 ranks with a batch-size and an lr change mid-epoch trains every
sample of the interrupted epoch once and ends its LR schedule exactly; settings outside the allowlist are refused
before anything is written."""
import math
import signal
import time
from collections import Counter

import pytest
import torch
import yaml

from tests.conftest import launch_ranks, record_fault, trainer, wait_all
from tests.timeouts import limit
from trainer.engine.logging import read_metrics
from trainer.engine.optim import lr_factor

N = 256      # the toy recipe's training samples


def ids_by_epoch(path) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for line in path.read_text().splitlines():
        epoch, _rank, *ids = map(int, line.split())
        seen.setdefault(epoch, Counter()).update(ids)
    return seen


@pytest.fixture(scope="module")
def sequence(tmp_path_factory):
    """Epoch 0 interrupted twice: 2 ranks x 16 stop after 3 steps (SIGUSR1 on rank 1), 1 rank x 24 after 2 more
    (SIGTERM), 3 ranks x 16 at lr 0.02 finish the run."""
    root = tmp_path_factory.mktemp("changed")
    run_dir, ids = root / "run", root / "ids.txt"
    base = ("train", "--recipe", "toy", "--epochs", "2", "--seed", "3", "log.tensorboard=false", "--lr", "0.01",
            "--run-dir", str(run_dir), f"data.log_ids={ids}", "log.every_steps=1")
    first = wait_all(launch_ranks(2, *base, "--batch-size", "16", "data.signal_at_step=3",
                                  "data.signal_name=SIGUSR1", "data.signal_rank=1"))
    assert [code for code, _ in first] == [128 + signal.SIGUSR1] * 2, first[0][1][-2000:]
    second = trainer(*base, "--batch-size", "24", "--resume", "auto", "data.signal_at_step=2", check=False)
    assert second.returncode == 128 + signal.SIGTERM, second.stderr[-2000:]
    third = wait_all(launch_ranks(3, *base, "--batch-size", "16", "--lr", "0.02", "--resume", "auto"))
    assert [code for code, _ in third] == [0] * 3, third[0][1][-3000:]
    return dict(run_dir=run_dir, ids=ids, second=second.stderr, third=third[0][1])


def test_every_sample_of_the_interrupted_epoch_is_trained_once(sequence):
    seen = ids_by_epoch(sequence["ids"])
    for epoch in (0, 1):
        counts = seen[epoch]
        assert set(counts) == set(range(N)), f"epoch {epoch}: {N - len(counts)} samples never trained"
        repeats = sum(counts.values()) - N
        assert repeats <= 3 - 1, f"epoch {epoch}: {repeats} repeats (at most world - 1 = 2 allowed)"
    assert "epoch 0 continues at sample 96 of 256" in sequence["second"]
    assert "resumed from" in sequence["second"] and "epoch 0, sample 96, step 3" in sequence["second"]
    assert "epoch 0 continues at sample 144 of 256" in sequence["third"]
    record_fault("requeued on another world size and batch size mid-epoch (2 -> 1 -> 3 ranks, batch 16 -> 24 -> 16, "
                 "lr changed)", steps_lost=0, outcome="every sample of the interrupted epoch trained once (2 padding "
                 "repeats), the LR schedule ends on the last step, each change logged and in metrics.jsonl")


def test_the_lr_schedule_ends_exactly_after_layout_changes(sequence):
    """The schedule is a function of the samples seen: converted at each resume, it reaches its end exactly on the
    last step, no step runs at lr 0, and the new lr applies from the resumed step."""
    final = torch.load(sequence["run_dir"] / "checkpoints" / "final.pt", weights_only=True)
    per_epoch_3x16 = math.ceil(math.ceil(N / 3) / 16)
    assert final["scheduler"]["last_epoch"] == 2 * per_epoch_3x16
    train = [r for r in read_metrics(sequence["run_dir"], "train") if "lr" in r]
    assert [r["step"] for r in train] == list(range(1, final["global_step"] + 1))
    # a record's lr is the next step's (logged after the schedule stepped): every step ran at lr > 0, and the
    # schedule's end (cosine to 0) comes exactly after the last step
    assert all(r["lr"] > 0 for r in train[:-1]) and train[-1]["lr"] == 0.0
    # 3 ranks x 16 resume at sample 144: 112 samples left = 3 of the epoch's 6 steps, so schedule step 3 of 12;
    # the record of step 6 (its first) shows the lr of schedule step 4
    resumed = next(r for r in train if r["step"] == 6)
    assert resumed["lr"] == pytest.approx(0.02 * lr_factor(4, 0, 12, "cosine"), rel=1e-6)
    assert "changed on resume: " in sequence["third"] and "optim.lr 0.01 -> 0.02" in sequence["third"]
    records = read_metrics(sequence["run_dir"], "resume")
    assert [r["step"] for r in records] == [3, 5]
    assert records[1]["changed"]["optim.lr"] == [0.01, 0.02]
    assert any("LR schedule continues at step 3 of 12" in note for note in records[1]["notes"])


def test_config_yaml_records_what_runs_and_keeps_the_previous(sequence):
    run_dir = sequence["run_dir"]
    now = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert now["optim"]["lr"] == 0.02 and now["train"]["batch_size"] == 16
    assert yaml.safe_load((run_dir / "config.3.yaml").read_text())["train"]["batch_size"] == 16
    assert yaml.safe_load((run_dir / "config.5.yaml").read_text())["train"]["batch_size"] == 24


def test_a_change_outside_the_allowlist_is_refused_before_anything_is_written(sequence):
    run_dir = sequence["run_dir"]
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    t0 = time.monotonic()
    refused = trainer("train", "--recipe", "toy", "--epochs", "3", "--seed", "3", "log.tensorboard=false",
                      "--run-dir", str(run_dir), "--resume", "auto", "model.hidden=32", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "model.hidden 16 -> 32 would change what this run is" in refused.stderr
    assert "Traceback" not in refused.stderr
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before                                 # the lock's bytes included
    record_fault("resume that changes a setting outside the allowlist (model.hidden)", steps_lost=0,
                 exit_s=round(time.monotonic() - t0, 2), outcome="exit 2 naming the setting, nothing written")


COUNT_LOADS = ("import collections, sys, torch\n"
               "loads, real = collections.Counter(), torch.load\n"
               "def counting(f, *a, **k):\n"
               "    loads[str(f)] += 1\n"
               "    return real(f, *a, **k)\n"
               "torch.load = counting\n"
               "from trainer.cli import main\n"
               "code = main(sys.argv[1:])\n"
               "print('LOADS', dict(loads))\n"
               "sys.exit(code)\n")


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_resume_reads_its_checkpoint_once(tmp_path, resume):
    """The config check, the search for the newest checkpoint and the restore each read it (three full reads of what
    may be gigabytes, on every relaunch); now the check's read is handed on."""
    import subprocess

    from tests.conftest import PY, REPO, clean_env
    run = tmp_path / "run"
    args = ["train", "--recipe", "toy", "--seed", "3", "--epochs", "2", "log.tensorboard=false",
            "--run-dir", str(run)]
    stopped = trainer(*args, "data.signal_at_step=6", check=False)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    ckpt = max((run / "checkpoints").glob("step-*.pt"))
    proc = subprocess.run([PY, "-c", COUNT_LOADS, *args, "--resume", "auto" if resume == "auto" else str(ckpt)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("runs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loads = eval(proc.stdout.split("LOADS ", 1)[1])        # noqa: S307 - our own print of a dict of str -> int
    assert loads.get(str(ckpt)) == 1, loads
    assert f"resumed from {ckpt}" in proc.stderr

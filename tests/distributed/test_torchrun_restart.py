"""torchrun --max-restarts (issue 48, point 3): after a worker dies, the agent restarts the group and every rank
resumes from the same agreed checkpoint in the same run directory, ending bitwise equal to an uninterrupted run."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, free_port, record_fault, run_ranks, weights
from tests.timeouts import limit
from trainer.engine.logging import read_metrics


def toy_yaml(folder, crash: str):
    path = folder / "toy.yaml"
    path.write_text("recipe: toy\nseed: 5\ndata:\n  step_sleep: 0.05\n" + crash + "train:\n  epochs: 3\n"
                    "  batch_size: 16\n  log_every_steps: 1\n  log_per_rank: true\n  num_workers: 1\n"
                    "ckpt:\n  every_steps: 4\n")
    return str(path)


@pytest.mark.long        # 40-45 s of torchrun runs: make test-fast leaves it out
def test_a_worker_killed_under_torchrun_restarts_the_group_from_the_agreed_checkpoint(tmp_path):
    """Rank 0 (the run-directory lock's holder, with a loader worker) SIGKILLs itself at step 10 of the first launch."""
    run = tmp_path / "run"
    cfg = toy_yaml(tmp_path, "  crash_at_step: 10\n  crash_rank: 0\n  crash_how: kill\n")
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--max-restarts", "1", "-m", "trainer", "train", "--config", cfg, "--run-dir", str(run), "--resume", "auto"]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("start"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "failed (exitcode: -9) local_rank: 0" in proc.stderr
    assert "resumed from" in proc.stderr and "step-00000008.pt" in proc.stderr
    exits = [json.loads((run / "exits" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(e["kind"], e["restart"]) for e in exits] == [("done", 1), ("done", 1)]     # the restarted group's
    for rank in (0, 1):      # each rank's own log keeps both launches (appended, not truncated)
        assert (run / f"train.rank{rank}.log").read_text().count("recipe=toy world=2") == 2
    ref = tmp_path / "ref"
    run_ranks(2, "train", "--config", toy_yaml(tmp_path, ""), "--run-dir", str(ref))
    assert_bitwise_equal(weights(run), weights(ref))
    train = [r for r in read_metrics(run) if r["split"] == "train"]
    gaps = [train[i]["time"] - train[i - 1]["time"] for i in range(1, len(train))]
    back = 1 + gaps.index(max(gaps))           # the restart: the longest pause between two logged steps
    record_fault("torchrun --max-restarts 1: rank 0 (with a loader worker) SIGKILLed after the 2nd checkpoint",
                 steps_lost=train[back - 1]["step"] - 8, exit_s=round(train[back]["time"] - train[back - 1]["time"], 1),
                 outcome="the agent restarts both ranks (time: the last step logged to training again), bitwise equal "
                         "to an uninterrupted run")

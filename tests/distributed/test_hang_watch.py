"""A hung rank found in seconds, not after dist.timeout_s (issue 69 point 3), with two real ranks: rank 1 SIGSTOPs
itself mid-epoch (alive, silent, its threads stopped too); rank 0's hang watch names it, dumps its own stacks into
RUN_DIR/hangs/ and exits 6 with its exit record. (The restart loop's relaunch: tests/slurm/test_restart_loop.py.)"""
import json
import signal
import time

from tests.conftest import launch_ranks
from tests.timeouts import limit
from trainer.engine.logging import read_metrics

TIMEOUT = 4


def test_a_stopped_rank_is_named_and_the_others_exit_6_within_the_timeout(tmp_path):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text("recipe: toy\nseed: 5\ndata:\n  step_sleep: 0.05\n  crash_at_step: 10\n  crash_rank: 1\n"
                   "  crash_how: stop\ntrain:\n  epochs: 20\n  batch_size: 16\n  log_every_steps: 1\n"
                   "  tensorboard: false\n")
    run = tmp_path / "run"
    procs = launch_ranks(2, "train", "--config", str(cfg), "--run-dir", str(run), f"faults.hang_timeout_s={TIMEOUT}",
                         "dist.timeout_s=600")
    try:
        _, err = procs[0].communicate(timeout=limit("run"))
        stopped_at = max(r["time"] for r in read_metrics(run, "train"))
        ended = time.time()
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
    assert procs[0].returncode == 6, err[-3000:]
    assert "hang: rank 1 " in err and "its hang watch has been silent" in err
    assert ended - stopped_at < TIMEOUT + 15                  # found in seconds (dist.timeout_s is 600 here)
    text = (run / "hangs" / "rank-0.txt").read_text()
    assert "its hang watch has been silent" in text and "Thread" in text
    record = json.loads((run / "exits" / "rank-0.json").read_text())
    assert (record["code"], record["kind"]) == (6, "hang")
    assert json.loads((run / "exits" / "rank-1.json").read_text())["kind"] == "running"

"""`make demo` end to end (one epoch): data generated, 2-process DDP, table and paths printed."""
import re
import subprocess

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit


def test_demo_runs_and_reports(tmp_path):
    proc = subprocess.run([PY, "-m", "trainer.cli.demo", "--epochs", "1", "--out", str(tmp_path)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2-process DDP" in proc.stdout and "ndcg@10" in proc.stdout and "test " in proc.stdout
    assert "tensorboard --logdir" in proc.stdout
    run = next(tmp_path.glob("demo-2*"))
    assert (run / "checkpoints" / "best.pt").exists() and (run / "tb").is_dir()
    log = (run / "train.log").read_text()
    assert "world=2" in log
    # the checkpoint line names the epoch as the evaluation line before it does (not the epoch a resume starts)
    assert re.search(r"val after epoch 0 \([\d.]+ s\): .*ndcg@10 0\.\d{4}  ", log), log[-2000:]   # name value pairs
    assert "{'" not in log                                                       # no Python dict on a log line
    assert re.search(r"first step done [\d.]+ s after the process started", log)
    assert re.search(r"saved best checkpoint \S+ \(after epoch 0, step \d+\)", log), log[-2000:]

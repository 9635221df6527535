"""bench/sasrec_losses.py's `ce` trained through the trainer at a generated catalogue (issue 71 point 4), joined to
a report already there (--update keeps its loss rows and memory probe); an unknown loss refused."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # a short training: make test-fast leaves it out


def test_ce_trained_at_a_generated_catalogue_joins_the_report(tmp_path):
    earlier = dict(runs=[dict(loss="bce", seed=0, test_full_hr10=0.1, test_full_ndcg10=0.05, epoch_time_s=0.5,
                              epochs_run=3, peak_rss_mb=500.0, val_curve=[[1, 0.01]])],
                   full_softmax_memory=[dict(items=27000, chunk_positions=2485, extra_peak_mb=796.0,
                                             forward_backward_s=8.5, plain_logits_float32_gb=2.76,
                                             plain_logits_bf16_gb=1.38)])
    (tmp_path / "sasrec_losses.json").write_text(json.dumps(earlier))
    proc = subprocess.run([PY, "-m", "bench.sasrec_losses", "--data", str(tmp_path), "--losses", "", "--sizes", "",
                           "--trained", "2500", "--trained-users", "150", "--update", "--out", str(tmp_path)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "sasrec_losses.json").read_text())
    (row,) = report["full_softmax_trained"]
    assert (row["items"], row["users"]) == (2500, 150) and row["steps"] >= 1
    assert row["epoch_time_s"] > 0 and row["test_eval_time_s"] > 0 and row["peak_rss_mb"] > 100
    assert report["runs"] == earlier["runs"] and report["full_softmax_memory"] == earlier["full_softmax_memory"]
    assert "ce trained at 2,500 items (150 generated users" in proc.stdout
    config = (tmp_path / "runs" / "ce-catalogue-2500" / "config.yaml").read_text()
    assert "kind: ce" in config and "synthetic_items: 2500" in config


def test_an_unknown_loss_is_refused(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.sasrec_losses", "--losses", "ce,cee", "--out", str(tmp_path)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("run"))
    assert proc.returncode == 2 and "unknown ['cee']" in proc.stderr

"""The benchmark harness: its arithmetic on synthetic timings, and one short run through `python -m bench`
(no timing assertions)."""
import json
import subprocess

import numpy as np
import pytest

from bench.harness import percentile, scaling_efficiency, step_stats
from tests.conftest import PY, REPO, clean_env


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = np.random.default_rng(0).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_step_stats_weigh_steps_by_their_time_and_skip_the_warmup():
    records = [dict(samples_per_s=10.0, step_time_s=5.0, data_wait_frac=1.0, rss_mb=900.0)]   # warm-up step
    records += [dict(samples_per_s=100.0, step_time_s=0.1, data_wait_frac=0.5, rss_mb=100.0),   # 10 samples
                dict(samples_per_s=20.0, step_time_s=0.5, data_wait_frac=0.0, rss_mb=120.0),    # 10 samples
                dict(samples_per_s=40.0, step_time_s=0.25, data_wait_frac=0.2, rss_mb=110.0)]   # 10 samples
    s = step_stats(records, warmup=1)
    assert s["steps"] == 3
    assert s["samples_per_s"] == pytest.approx(30 / 0.85)              # totals, not the mean of the rates
    assert s["data_wait_frac"] == pytest.approx((0.05 + 0.05) / 0.85)
    assert s["step_time_median_s"] == pytest.approx(0.25) and s["step_time_p90_s"] == pytest.approx(0.45)
    assert s["peak_rss_mb"] == 900.0                                     # peaks include the warm-up
    with pytest.raises(ValueError, match="no training steps after a warm-up of 4"):
        step_stats(records, warmup=4)


def test_scaling_efficiency():
    assert scaling_efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    assert scaling_efficiency(100.0, 1, 100.0) == 1.0
    with pytest.raises(ValueError):
        scaling_efficiency(1.0, 2, 0.0)


def test_bench_smoke_runs_a_recipe_at_two_world_sizes(tmp_path):
    proc = subprocess.run([PY, "-m", "bench", "har", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"har-w{w}.json").read_text()) for w in (1, 2))
    assert one["recipe"] == two["recipe"] == "har" and (one["world"], two["world"]) == (1, 2)
    assert one["steps"] == two["steps"] == 2 and one["samples_per_s"] > 0 and "macro_f1" in one["metrics"]
    assert "scaling_efficiency" in two and "scaling_efficiency" not in one
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"][0]["scaling_efficiency_w2"] == two["scaling_efficiency"]
    assert "| har |" in (tmp_path / "summary.md").read_text() and (tmp_path / "summary.png").stat().st_size > 5000

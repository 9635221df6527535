"""The benchmark harness: its arithmetic on synthetic timings, and one short run through `python -m bench`
(no timing assertions)."""
import json
import subprocess

import numpy as np
import pytest

from bench.harness import cost_shares, percentile, phase_extra_ms, repeat_efficiency, scaling_efficiency, step_stats
from bench.report import tables
from bench.run import summarize
from tests.conftest import REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = np.random.default_rng(0).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_step_stats_weigh_steps_by_their_time_and_skip_the_warmup():
    records = [dict(samples_per_s=10.0, step_time_s=5.0, data_wait_frac=1.0, rss_mb=900.0)]   # warm-up step
    records += [dict(samples_per_s=100.0, step_time_s=0.1, data_wait_frac=0.5, rss_mb=100.0),   # 10 samples
                dict(samples_per_s=20.0, step_time_s=0.5, data_wait_frac=0.0, rss_mb=120.0,     # 10 samples
                     sync_wait_frac=0.1),
                dict(samples_per_s=40.0, step_time_s=0.25, data_wait_frac=0.2, rss_mb=110.0)]   # 10 samples
    s = step_stats(records, warmup=1)
    assert s["steps"] == 3
    assert s["samples_per_s"] == pytest.approx(30 / 0.85)              # totals, not the mean of the rates
    assert s["data_wait_frac"] == pytest.approx((0.05 + 0.05) / 0.85)
    assert s["sync_wait_frac"] == pytest.approx(0.05 / 0.85)           # absent = not measured = 0
    assert s["step_time_mean_s"] == pytest.approx(0.85 / 3)
    assert s["step_time_median_s"] == pytest.approx(0.25) and s["step_time_p90_s"] == pytest.approx(0.45)
    assert s["peak_rss_mb"] == 900.0                                     # peaks include the warm-up
    with pytest.raises(ValueError, match="no training steps after a warm-up of 4"):
        step_stats(records, warmup=4)


def test_scaling_efficiency():
    assert scaling_efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    assert scaling_efficiency(100.0, 1, 100.0) == 1.0
    with pytest.raises(ValueError):
        scaling_efficiency(1.0, 2, 0.0)


def test_repeat_efficiency_from_medians_and_paired_repeats():
    # the best-of figure would be 190 / (2 x 130) = 0.73; the medians and each interleaved pair say otherwise
    got = repeat_efficiency([100.0, 130.0, 90.0], [180.0, 190.0, 150.0], 2)
    assert got["median"] == pytest.approx(180.0 / (2 * 100.0))
    assert got["paired_min"] == pytest.approx(190.0 / 260.0) and got["paired_max"] == pytest.approx(0.9)
    with pytest.raises(ValueError):
        repeat_efficiency([], [], 2)


def test_cost_shares_split_one_minus_efficiency():
    # one rank 0.20 s a step; two independent processes 0.21 s; DDP 0.25 s, of which 0.015 s waiting for gradients
    c = cost_shares(0.20, 0.25, 0.21, 0.015)
    assert c["machine_sharing"] == pytest.approx(0.04) and c["sync_wait"] == pytest.approx(0.06)
    assert c["other"] == pytest.approx(0.10)
    assert sum(c.values()) == pytest.approx(1 - 0.20 / 0.25)      # = 1 - scaling efficiency
    assert cost_shares(0.2, 0.2, 0.19, 0.0)["machine_sharing"] < 0   # noise shows, it is not clipped
    with pytest.raises(ValueError):
        cost_shares(0.2, 0.0, 0.2, 0.0)


def test_phase_times_and_what_ddp_adds_per_phase():
    steps = [dict(samples_per_s=10.0, step_time_s=t, forward_frac=f, backward_frac=b)
             for t, f, b in [(0.1, 0.4, 0.5), (0.3, 0.2, 0.7)]]
    s = step_stats(steps, warmup=0)
    assert s["forward_s"] == pytest.approx((0.04 + 0.06) / 2) and s["backward_s"] == pytest.approx((0.05 + 0.21) / 2)
    untimed = dict(samples_per_s=1.0, step_time_s=0.1)
    assert "forward_s" not in step_stats([steps[1], untimed], warmup=0)   # a step without it: not reported
    ddp = dict(step_time_mean_s=0.060, forward_s=0.022, backward_s=0.028)
    alone = dict(step_time_mean_s=0.049, forward_s=0.021, backward_s=0.024)
    x = phase_extra_ms(ddp, alone)
    assert x == pytest.approx(dict(forward=1.0, backward=4.0, rest=6.0))
    assert sum(x.values()) == pytest.approx(1000 * (0.060 - 0.049))      # the parts add up to the difference
    assert phase_extra_ms(dict(step_time_mean_s=0.06), alone) is None


@pytest.mark.slurm
def test_make_bench_smoke_runs_every_launch_path(tmp_path, slurm_cluster):
    args = f"har --steps 2 --warmup 1 --repeat 1 --slurm on --out {tmp_path}"
    proc = subprocess.run(["make", "-s", "bench", "BENCH_SLURM=0", f"BENCH_ARGS={args}"], cwd=REPO,
                          env=clean_env(HPC_CLUSTER_DIR=str(slurm_cluster.parent)), capture_output=True, text=True,
                          timeout=limit("job"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = {(r["launcher"], r["world"]): r for r in
            (json.loads(p.read_text()) for p in tmp_path.glob("har-*-w*.json"))}
    assert set(runs) == {("torchrun", 1), ("torchrun", 2), ("independent", 2), ("slurm", 2)}
    one, ddp, slurm = runs[("torchrun", 1)], runs[("torchrun", 2)], runs[("slurm", 2)]
    assert all(r["recipe"] == "har" and r["steps"] == 2 and r["samples_per_s"] > 0 for r in runs.values())
    assert "macro_f1" in one["metrics"] and one["epochs_timed"] == [0] and one["first_step_s"] > 0
    assert "scaling_efficiency" not in one and {"scaling_efficiency", "costs", "collectives"} <= set(ddp)
    assert ddp["collectives"]["via"] == "shm" and ddp["collectives"]["gloo_grad_ms"] > 0   # as trained; gloo
    assert "scaling_efficiency" in slurm and 0 < ddp["sync_wait_frac"] < 1        # measured by the DDP hook
    assert sum(ddp["costs"].values()) == pytest.approx(
        1 - one["step_time_mean_s"] / ddp["step_time_mean_s"], abs=1e-3)
    shared = runs[("independent", 2)]
    assert sum(ddp["ddp_extra_ms"].values()) == pytest.approx(           # phases timed in every run
        1000 * (ddp["step_time_mean_s"] - shared["step_time_mean_s"]), abs=0.01)
    assert 0 < one["forward_s"] and 0 < one["backward_s"]
    assert one["forward_s"] + one["backward_s"] < one["step_time_mean_s"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    row = summary["rows"][0]
    assert summary["slurm"] and row["efficiency_ddp"] == ddp["scaling_efficiency"]
    assert row["efficiency_ddp_repeats"]["median"] == pytest.approx(ddp["scaling_efficiency"], abs=1e-3)  # 1 repeat
    assert row["slurm_vs_torchrun"] == pytest.approx(slurm["samples_per_s"] / ddp["samples_per_s"], rel=1e-3)
    md = (tmp_path / "summary.md").read_text()
    assert row["ddp_extra_ms"] == ddp["ddp_extra_ms"] and "DDP step - independent step" in md
    assert "| har |" in md and (tmp_path / "summary.png").stat().st_size > 5000


def test_the_summary_states_the_single_rank_runs_own_spread():
    """The machine's drift, measured with one process alone: the fastest over the slowest 1-rank repeat."""
    def rec(launcher, world, repeats):
        return dict(recipe="har", launcher=launcher, world=world, samples_per_s=max(repeats), step_time_median_s=0.1,
                    step_time_p90_s=0.11, data_wait_frac=0.01, peak_rss_mb=500, eval_time_s=1.0, first_step_s=2.0,
                    params=10, repeats_samples_per_s=repeats, scaling_efficiency=max(repeats) / 148)
    rows = summarize([rec("torchrun", 1, [52.5, 73.5, 63.7]), rec("torchrun", 2, [100.0, 117.3, 108.0])])
    assert rows[0]["single_rank_spread"] == pytest.approx(1.4)
    assert "| 1.40x |" in tables(rows) and "fastest / slowest repeat" in tables(rows)
    assert "single_rank_spread" not in summarize([rec("torchrun", 1, [50.0]), rec("torchrun", 2, [90.0])])[0]

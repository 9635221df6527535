"""bench/kgat.py smoke run (2 epochs + a 1-epoch scale run on the tiny preset): JSON and PNG written, the
per-phase timings recorded; no timing assertions."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.inprocess import cli
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out

ML100K = REPO.parent / "shared" / "data" / "ml-100k"


def test_kgat_bench_smoke(tmp_path):
    data = ML100K
    if not ML100K.exists():   # synthetic fallback: the same harness on a generated KGAT-format folder
        print(f"{ML100K} missing: benchmarking synthetic KGAT data instead")
        data = tmp_path / "synth"
        cli("data", "synth", "kgat", "--out", str(data), "--preset", "tiny")
    proc = subprocess.run([PY, "-m", "bench.kgat", "--data", str(data), "--epochs", "2", "--scale", "tiny",
                           "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "kgat.json").read_text())
    ours, scale = report["ml100k"], report["scale"]
    assert ours["epochs"] == 2 and len(ours["per_epoch"]) == 2 and ours["curve"][-1][0] == 2
    assert all(e["cf_s"] > 0 and e["kg_s"] > 0 and e["att_s"] > 0 for e in ours["per_epoch"])
    assert 0 <= ours["recall20"] <= 1 and ours["eval_time_s"] > 0
    assert scale["preset"] == "tiny" and scale["users"] == 300 and scale["peak_rss_gib"] > 0
    assert (tmp_path / "out" / "kgat.png").stat().st_size > 10_000
    assert "reference" in proc.stdout and "scale tiny" in proc.stdout


def test_kgat_scale_bench_smoke(tmp_path):
    """bench/kgat_scale.py on the tiny preset at 1/2 and full size, 1 and 2 ranks: every phase timed, the work
    units and memory figures consistent with the data's sizes, slopes fitted, the plot written."""
    proc = subprocess.run([PY, "-m", "bench.kgat_scale", "--preset", "tiny", "--fractions", "0.5,1", "--cf-steps", "1",
                           "--kg-steps", "1", "--eval-batch", "64", "--out", str(tmp_path)], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "kgat_scale.json").read_text())
    points = {(p["fraction"], p["world"]): p for p in report["points"]}
    assert set(points) == {(0.5, 1), (0.5, 2), (1.0, 1), (1.0, 2)}
    full, half = points[1.0, 1], points[0.5, 1]
    assert (full["users"], full["items"], full["triples"]) == (300, 200, 2400) and half["users"] == 150
    for p in report["points"]:
        assert all(p["phase_s"][k] > 0 for k in ("cf", "kg", "attention", "eval")), p
        assert p["work"]["eval"] == p["test_users"] * p["items"] and p["work"]["attention"] == p["edges"]
        assert p["work"]["cf"] == p["cf_steps"] * p["edges"] and 0 <= p["recall20"] <= 1
        assert p["eval_batch_scores_gib"] < p["dense_scores_gib"] and p["peak_rss_gib"] > 0
        warm = p["warmup_steps_s"]["cf"]              # the first steps counted once, the steady mean for the rest
        assert len(warm) == min(2, p["cf_steps"]) and all(t > 0 for t in warm)
        assert len(p["attention_runs_s"]) == 3 and p["phase_s"]["attention"] == sorted(p["attention_runs_s"])[1]
        assert p["phase_s"]["cf"] == pytest.approx(sum(warm) + p["cf_step_s"] * (p["cf_steps"] - len(warm)))
    assert points[1.0, 2]["cf_steps"] < full["cf_steps"]                 # two ranks share the epoch's steps
    assert points[1.0, 2]["allreduce_via"] == "shm" and full["allreduce_via"] == "none"   # the trainer's path
    assert set(report["slopes"]) == {f"{k}_w{w}" for k in ("cf", "kg", "attention", "eval") for w in (1, 2)}
    assert (tmp_path / "kgat_scale.png").stat().st_size > 10_000


def test_kgat_scale_repeats_take_each_points_median_and_slopes_fit_the_powers():
    from bench import kgat_scale as ks

    def run(fraction, world, cf, kg=1.0):
        work = dict(cf=fraction ** 2 * 100, kg=fraction * 10, attention=fraction * 5, eval=fraction * 7)
        return dict(fraction=fraction, world=world, work=work, cf_step_s=cf, kg_step_s=kg, peak_rss_gib=1.0,
                    setup_s=0.5, optimizer_step_s=dict(cf=0.1, kg=0.2),
                    phase_s=dict(cf=work["cf"] ** 1.5 * cf, kg=work["kg"] * kg, attention=work["attention"],
                                 eval=work["eval"] ** 0.5))
    point = ks.median_point([run(1.0, 1, 3.0), run(1.0, 1, 1.0), run(1.0, 1, 100.0)])
    base = 100 ** 1.5                                        # the cf work at fraction 1 is 100
    assert point["cf_step_s"] == 3.0 and point["phase_s"]["cf"] == base * 3.0 and point["phase_s"]["kg"] == 10
    assert point["phase_s_runs"]["cf"] == [base * 3.0, base, base * 100.0]
    slopes = ks.fit_slopes([run(f, w, 1.0) for f in (0.25, 0.5, 1.0) for w in (1, 2)], "1,2")
    assert slopes["cf_w1"] == slopes["cf_w2"] == 1.5 and slopes["kg_w1"] == 1.0 and slopes["eval_w2"] == 0.5

"""bench/kgat.py smoke run (2 epochs + a 1-epoch scale run on the tiny preset): JSON and PNG written, the
per-phase timings recorded; no timing assertions."""
import json
import subprocess

from tests.conftest import PY, REPO, clean_env

ML100K = REPO.parent / "shared" / "data" / "ml-100k"


def test_kgat_bench_smoke(tmp_path):
    data = ML100K
    if not ML100K.exists():   # synthetic fallback: the same harness on a generated KGAT-format folder
        print(f"{ML100K} missing: benchmarking synthetic KGAT data instead")
        data = tmp_path / "synth"
        subprocess.run([PY, "-m", "trainer", "data", "synth", "kgat", "--out", str(data), "--preset", "tiny"],
                       check=True, cwd=REPO, env=clean_env())
    proc = subprocess.run([PY, "bench/kgat.py", "--data", str(data), "--epochs", "2", "--scale", "tiny",
                           "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "kgat.json").read_text())
    ours, scale = report["ml100k"], report["scale"]
    assert ours["epochs"] == 2 and len(ours["per_epoch"]) == 2 and ours["curve"][-1][0] == 2
    assert all(e["cf_s"] > 0 and e["kg_s"] > 0 and e["att_s"] > 0 for e in ours["per_epoch"])
    assert 0 <= ours["recall20"] <= 1 and ours["eval_time_s"] > 0
    assert scale["preset"] == "tiny" and scale["users"] == 300 and scale["peak_rss_gib"] > 0
    assert (tmp_path / "out" / "kgat.png").stat().st_size > 10_000
    assert "reference" in proc.stdout and "scale tiny" in proc.stdout

"""bench/sasrec.py smoke run (2 epochs, one variant): JSON and PNG written, no timing assertions."""
import json
import subprocess

from tests.conftest import PY, REPO, clean_env

ML100K = REPO.parent / "shared" / "data" / "ml-100k"


def test_sasrec_bench_smoke(tmp_path):
    data = ML100K
    if not ML100K.exists():   # synthetic fallback: the same harness on generated data
        data = tmp_path / "synth"
        subprocess.run([PY, "-m", "trainer", "data", "synth", "sasrec", "--out", str(data), "--users", "120"],
                       check=True, cwd=REPO, env=clean_env())
    proc = subprocess.run([PY, "bench/sasrec.py", "--data", str(data), "--epochs", "2", "--variants", "sasrec",
                           "--out", str(tmp_path / "out")], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "sasrec.json").read_text())
    (result,) = report["results"]
    assert result["recipe"] == "sasrec" and result["epochs"] == 2 and len(result["epoch_times_s"]) == 2
    assert 0 <= result["test_best"]["ndcg10"] <= 1 and "full_ndcg@10" in result["test_best_full"]
    assert (tmp_path / "out" / "sasrec.png").stat().st_size > 10_000
    assert "reference" in proc.stdout

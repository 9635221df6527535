"""bench/har.py smoke run (one seed, one mode, a few steps): JSON and PNG written, no timing assertions."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_har_bench_smoke(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.har", "--seeds", "0", "--modes", "first", "--steps", "4",
                           "--basic-epochs", "3", "--synth-preset", "tiny",
                           "--out", str(tmp_path)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "har.json").read_text())
    assert report["recipe"] == "har" and [r["mode"] for r in report["basicmotions"]] == ["first"]
    assert 0 <= report["basicmotions"][0]["test_accuracy"] <= 1
    assert [r["setup"] for r in report["throughput"]] == ["single", "ddp", "dp"]
    assert all(r["samples_per_s"] > 0 for r in report["throughput"]) and "skipped" in report["uci_har"]
    assert (tmp_path / "har.png").stat().st_size > 10_000

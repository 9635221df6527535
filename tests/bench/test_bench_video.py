"""bench/video.py smoke run (tiny clips, a few steps): JSON and PNG written, no timing assertions."""
import json
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_video_bench_smoke(tmp_path):
    proc = subprocess.run([PY, "-m", "bench.video", "--archs", "light", "--size", "32", "--clip", "5", "--steps", "4",
                           "--workers", "1", "--out", str(tmp_path)], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "video-cpu.json").read_text())
    (r,) = report["results"]
    assert r["recipe"] == "video" and r["arch"] == "light" and r["clip"] == [5, 32, 32]
    assert r["samples_per_s"] > 0 and 0 <= r["data_wait_frac"] <= 1 and r["train_gflop_per_sample"] > 0
    assert (tmp_path / "video-cpu.png").stat().st_size > 10_000

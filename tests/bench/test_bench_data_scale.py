"""bench/data_scale.py's plumbing on small files: every probe runs in its own process, the figures are consistent
(every probe read the same rows; the warm start maps the cache the cold build wrote; two ranks share its pages),
and the JSON and PNG are written. The figures at 2M and 20M rows are the committed bench/results/data_scale.json."""
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env
from tests.timeouts import limit

pytestmark = pytest.mark.long      # long CPU work: make test-fast leaves it out


def test_the_data_scale_bench_runs_through(tmp_path):
    parquet = importlib.util.find_spec("pyarrow") is not None      # the `parquet` extra (make setup installs it)
    if not parquet:
        print("pyarrow absent: the Parquet row of the bench is left out of this run")
    proc = subprocess.run([sys.executable, "-m", "bench.data_scale", "--sizes", "40000,80000", "--repeat", "1",
                           "--parquet-sizes", "40000" if parquet else "", "--kgat-scales", "0.01",
                           "--eval-users", "200", "--data", str(tmp_path / "data"), "--out", str(tmp_path),
                           "--history", str(tmp_path / "history.jsonl")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "data_scale.json").read_text())
    assert set(report["sizes"]) == {"40000", "80000"} and "cold_no_cache" in report["slope_per_million_rows"]
    for r in report["sizes"].values():
        assert r["rows"] > 30_000 and r["cache_mb"] > 0 and r["file_mb"] > r["cache_mb"] / 2
        assert r["warm"]["s"] < r["cold_build"]["s"]                  # mapped, not parsed again
        assert len(r["two_ranks"]) == 2 and all(t["rows"] == r["rows"] for t in r["two_ranks"])
        assert ("cold_over_pandas" in r) == report["pandas"]
        assert r["train"]["steps"] > 0 and r["train"]["steps_per_s"] > 0 and 0 < r["train"]["eval_users"] <= 200
        assert r["warm_start"]["rss_mb"] > 100 and r["warm_start"]["s"] > 0       # a training process: torch in it
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert {h["size"] for h in history} == {"40000", "80000"} and all(h["warm_start_rss_mb"] > 0 for h in history)
    assert report["changes"] == []                    # nothing recorded before this run
    if parquet:                         # the same generator's rows, read from Parquet, against a bare pyarrow read
        r = report["parquet"]["40000"]
        assert r["rows"] == report["sizes"]["40000"]["rows"] and r["arrow"]["s"] > 0
        assert r["cold_over_arrow"] > 0 and r["warm"]["s"] < r["cold_build"]["s"] and r["train"]["steps"] > 0
    kgat = report["kgat"]["x0.01"]                # amazon-book's statistics x 0.01: read, cached, mapped
    assert kgat["rows"] > report["kgat"]["tiny"]["rows"] and kgat["warm"]["s"] < kgat["cold_build"]["s"]
    assert len(kgat["two_ranks"]) == 2 and kgat["cache_mb"] > 0
    assert (tmp_path / "data_scale.png").stat().st_size > 10_000
    # --update: a KGAT-only run keeps the SASRec sections of the report it updates
    proc = subprocess.run([sys.executable, "-m", "bench.data_scale", "--sizes", "", "--parquet-sizes", "",
                           "--kgat-scales", "0.02", "--repeat", "1", "--update", "--data", str(tmp_path / "data"),
                           "--out", str(tmp_path)], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("jobs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    updated = json.loads((tmp_path / "data_scale.json").read_text())
    assert updated["sizes"] == report["sizes"] and set(updated["kgat"]) == {"tiny", "x0.02"}


def test_a_change_of_more_than_ten_percent_since_the_last_commit_is_named():
    """Issue 88: the history's last row of the same size from another commit is the reference; within 10% is quiet."""
    from bench.data_scale import changes_since
    history = [dict(commit="10eb9f3", date="d1", size="20000000", warm_start_rss_mb=498.0, cold_build_s=3.4),
               dict(commit="aaaaaaa", date="d2", size="2000000", warm_start_rss_mb=400.0, cold_build_s=1.0),
               dict(commit="306df1d", date="d3", size="20000000", warm_start_rss_mb=500.0, cold_build_s=3.5)]
    same = dict(commit="306df1d", size="20000000", warm_start_rss_mb=722.0, cold_build_s=3.6)
    said = changes_since(history, [same])          # its own commit's row is skipped: 10eb9f3 is the reference
    assert said == ["size 20000000: warm_start_rss_mb 498 -> 722 (+45%) since 10eb9f3 (d1)"]
    new = dict(commit="bbbbbbb", size="20000000", warm_start_rss_mb=530.0, cold_build_s=4.2)
    assert changes_since(history, [new]) == ["size 20000000: cold_build_s 3.5 -> 4.2 (+20%) since 306df1d (d3)"]
    assert changes_since(history, [dict(commit="c", size="1", warm_start_rss_mb=1.0)]) == []    # no earlier row

"""Issue 58 item 1: the pre-flight. Before the first step each rank checks its device (a matmul, the free memory
against the model's estimate, an allocation) and the group its links (an all-reduce within each host and across
the group, each rank's time to join); RUN_DIR/preflight.json, one log line, `doctor --run`, `doctor --preflight`.
A host below SLOW_FRACTION of the hosts' median, or failing a check, stops the run with exit 5 naming it; the
restart loop leaves such a host out at once.

The slowed host is slowed for real: its rank is pinned to one core beside busy loops at a nice session's weight,
about a twentieth of the core, the other rank on the other core (tests/conftest.py slowed_rank); nothing is injected
into the trainer."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import launch_ranks, record_fault, run_ended, slowed_rank, trainer, wait_all
from trainer.distributed.preflight import SLOW_FRACTION, RankFigures, judge
from trainer.engine.rundir import MARKER
from trainer.launch.exitcodes import UNFIT_HOST, unfit_hosts

TOY = ("train", "--recipe", "toy", "--epochs", "1", "train.tensorboard=false", "train.preflight=on")


def figures(host, rank, gflops, bw=None, failed=()):
    return RankFigures(rank=rank, host=host, device="cpu", gflops=gflops, host_busbw_gbs=bw, failed=list(failed))


def test_the_rule_names_a_host_three_times_slower_and_not_the_machines_noise():
    assert SLOW_FRACTION == 0.5
    healthy = [figures("a", 0, 100.0), figures("b", 1, 100.0 / 1.5)]           # the noise seen here: 1.2-1.5x
    assert judge(healthy) == {}
    slowed = [figures("a", 0, 100.0), figures("b", 1, 100.0 / 3)]               # 3x: below half the median
    assert list(judge(slowed)) == ["b"] and "matmul 33.33 GFLOP/s" in judge(slowed)["b"]
    four = [figures(h, r, g) for r, (h, g) in enumerate([("a", 90), ("b", 100), ("c", 110), ("d", 40)])]
    assert list(judge(four)) == ["d"]
    assert judge([figures("a", 0, 100.0), figures("a", 1, 10.0)]) == {}         # one host: nothing to compare
    failed = [figures("a", 0, 100.0), figures("b", 1, 100.0, failed=["a 64 MiB allocation failed: x"])]
    assert "allocation failed" in judge(failed)["b"]
    links = [figures("a", 0, 100, 1.0), figures("a", 1, 100, 1.0), figures("b", 2, 100, 0.2), figures("b", 3, 100, 0.2),
             figures("c", 4, 100, 0.9), figures("c", 5, 100, 0.9)]
    assert list(judge(links)) == ["b"] and "all-reduce among its ranks" in judge(links)["b"]


def launch(n: int, run_dir, hosts: list[str], *extra: str) -> list[subprocess.Popen]:
    """n ranks, each on its own host name, each in a session of its own (slowed_rank)."""
    return launch_ranks(n, *TOY, "--run-dir", str(run_dir), *extra, rank_env=[{"SLURMD_NODENAME": h} for h in hosts],
                        own_sessions=True)


def test_two_healthy_ranks_write_the_report_and_train(tmp_path):
    start = time.monotonic()
    results = wait_all(launch(2, tmp_path / "run", ["nodeA", "nodeB"]))
    assert [c for c, _ in results] == [0, 0], results[0][1][-3000:]
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert [r["host"] for r in report["ranks"]] == ["nodeA", "nodeB"] and report["unfit"] == {}
    assert all(r["gflops"] > 0 and r["free_bytes"] > r["need_bytes"] > 0 for r in report["ranks"])
    assert report["group_busbw_gbs"] > 0 and report["seconds"] < 10
    assert "pre-flight: 2 rank(s) on 2 host(s)" in (tmp_path / "run" / "train.log").read_text()
    shown = trainer("doctor", "--run", str(tmp_path / "run")).stdout
    assert "pre-flight: 2 rank(s)" in shown and "rank 1 on nodeB" in shown
    record_fault("pre-flight of 2 healthy ranks (toy recipe, 2 hosts named)", exit_s=round(time.monotonic() - start, 2),
                 steps_lost=0, outcome=f"trains; the checks took {report['seconds']} s")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to slow one rank against the other")
def test_a_host_slowed_three_times_is_named_and_the_run_exits_5(tmp_path, busy_core_turn):
    run_dir = tmp_path / "run"
    procs = launch(2, run_dir, ["nodeA", "nodeB"])
    start = time.monotonic()
    # nodeB's rank on about a twentieth of a core, from when rank 0 has joined the group and claimed the run
    # directory (the ranks' imports done) until rank 1's exit record
    with slowed_rank(procs, rank=1, once=(run_dir / MARKER).exists, until=run_ended(run_dir, 1)):
        results = wait_all(procs, timeout=240)
    assert [c for c, _ in results] == [UNFIT_HOST, UNFIT_HOST], results[0][1][-3000:]
    line = [x for x in results[0][1].splitlines() if x.startswith("error:")][0]
    assert unfit_hosts(line) == ["nodeB"] and "matmul" in line
    assert "--exclude" in results[0][1]
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    a, b = report["ranks"]
    assert list(report["unfit"]) == ["nodeB"] and b["gflops"] < SLOW_FRACTION * a["gflops"]
    exits = [json.loads((tmp_path / "run" / "exits" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [e["kind"] for e in exits] == ["unfit-host", "unfit-host"]
    record_fault("a slowed host (its rank on a tenth of a core), 2 ranks",
                 exit_s=round(time.monotonic() - start, 2), steps_lost=0,
                 outcome=f"exit 5 naming it (matmul {b['gflops']:.0f} against {a['gflops']:.0f} GFLOP/s); the "
                 f"restart loop relaunches without it")


def test_the_checks_leave_the_runs_random_streams_alone():
    """A resumed run restores its RNG states before the pre-flight: the checks must not draw from them (a resume
    under torchrun was not bitwise when the matmul drew its operands from torch's global generator)."""
    import torch

    from trainer.distributed.preflight import matmul_gflops
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert matmul_gflops(torch.device("cpu"), torch.bfloat16) > 0
    assert torch.equal(torch.rand(4), expected)

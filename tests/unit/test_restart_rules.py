"""trainer/launch/restarts.py's rules on hand-made run directories: whom to blame, when not to relaunch (never-retried
codes, a checkpointed preemption, the count per allocation, the time left), which host to leave out."""
import json
import os
import time
from pathlib import Path

import pytest

from trainer.launch.restarts import Attempt, decide, main, read_jsonl, summary

JOB, T0 = "77", 1_000_000.0


def record(run: Path, rank: int, kind: str, t: float, host: str = "node1", code=1, cause="boom", attempt=0,
           requeue=0):
    (run / "exits").mkdir(parents=True, exist_ok=True)
    code = None if kind == "running" else code
    (run / "exits" / f"rank-{rank}.json").write_text(json.dumps(dict(
        rank=rank, host=host, pid=100 + rank, code=code, kind=kind, cause=cause, time=t, job=JOB, requeue=requeue,
        attempt=attempt, restart=0)))


def attempt(run: Path, rc=1, n=0, max_restarts=2, start=T0, end=None, nodes=("node1", "node2"), excluded=(),
            requeue=0) -> Attempt:
    return Attempt(run, rc, n, max_restarts, start, T0 - 100, end, list(nodes), 2, list(excluded), JOB, requeue)


def checkpoint(run: Path, step: int, mtime: float) -> None:
    path = run / "checkpoints" / f"step-{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))


def test_a_rank_without_an_exit_record_is_blamed_before_the_ones_srun_ended(tmp_path):
    record(tmp_path, 0, "retryable", T0 + 10, cause="RuntimeError: Connection closed by peer")
    record(tmp_path, 1, "running", T0 + 1, host="node2")
    verdict, exclude, rec = decide(attempt(tmp_path, rc=143), now=T0 + 12)
    assert (verdict, exclude) == ("relaunch", []) and rec["ranks"] == [1] and rec["hosts"] == ["node2"]
    assert rec["failed_at"] == T0 + 10 and "without an exit record" in rec["cause"]


def test_a_rank_that_lost_its_peer_is_not_blamed_even_when_it_wrote_first(tmp_path):
    lost = "RuntimeError: shared-memory all-reduce: rank 1 (pid 9) has exited"
    record(tmp_path, 0, "retryable", T0 + 0.01, cause=lost)
    record(tmp_path, 1, "retryable", T0 + 0.05, cause="RuntimeError: toy: rank 1 crashes at step 10 (injected)")
    record(tmp_path, 2, "retryable", T0 + 0.02, cause="RuntimeError: Connection closed by peer [127.0.0.1]:4242")
    _, _, rec = decide(attempt(tmp_path, rc=143), now=T0 + 1)
    assert rec["ranks"] == [1] and rec["cause"].endswith("(injected)")


def test_the_first_rank_to_fail_is_blamed_and_older_attempts_records_are_ignored(tmp_path):
    record(tmp_path, 0, "retryable", T0 + 9, cause="RuntimeError: gloo lost its peer")
    record(tmp_path, 1, "retryable", T0 + 5, cause="RuntimeError: loader worker died")
    record(tmp_path, 2, "running", T0 - 50, attempt=5)       # another attempt's: not this one's
    _, _, rec = decide(attempt(tmp_path), now=T0 + 12)
    assert rec["ranks"] == [1] and rec["cause"] == "RuntimeError: loader worker died" and rec["codes"] == [1]


@pytest.mark.parametrize("rc, kind, reason", [(2, "usage", "usage error (exit 2)"),
                                              (3, "non-finite", "non-finite error (exit 3)"),
                                              (4, "resource", "resource error (exit 4)"),
                                              (7, "pruned", "pruned by the search's pruner (exit 7)"),
                                              (143, "preempted", "preempted after an agreed checkpoint")])
def test_what_would_fail_again_and_a_checkpointed_preemption_are_not_relaunched(tmp_path, rc, kind, reason):
    record(tmp_path, 0, kind, T0 + 3, code=rc)
    verdict, _, rec = decide(attempt(tmp_path, rc=rc), now=T0 + 5)
    assert verdict == "stop" and rec["reason"].startswith(reason)
    assert read_jsonl(tmp_path / "restarts.jsonl")[-1]["decision"] == "stop"


def test_the_count_is_per_allocation_and_a_requeue_starts_it_again(tmp_path):
    for n in range(2):
        record(tmp_path, 0, "retryable", T0 + n, attempt=n, host=f"node{n + 1}")
        assert decide(attempt(tmp_path, n=n), now=T0 + n + 1)[0] == "relaunch"
    record(tmp_path, 0, "retryable", T0 + 3, attempt=2, host="node3")
    verdict, _, rec = decide(attempt(tmp_path, n=2), now=T0 + 4)
    assert verdict == "stop" and rec["reason"] == "2 of MAX_RESTARTS=2 relaunches used in this allocation"
    record(tmp_path, 0, "retryable", T0 + 10, requeue=1)       # the same job after a Slurm requeue
    verdict, _, rec = decide(attempt(tmp_path, requeue=1), now=T0 + 11)
    assert verdict == "relaunch" and rec["restart"] == 1
    assert decide(attempt(tmp_path, max_restarts=0, requeue=1), now=T0 + 12)[2]["reason"].startswith("MAX_RESTARTS=0")


def test_no_relaunch_when_the_time_left_is_shorter_than_the_way_to_a_checkpoint(tmp_path):
    record(tmp_path, 0, "retryable", T0 + 30)
    # first relaunch: the job started 100 s before this attempt; 130 s have passed
    assert decide(attempt(tmp_path, end=T0 + 30 + 129), now=T0 + 30)[0] == "stop"
    assert decide(attempt(tmp_path, end=T0 + 30 + 131), now=T0 + 30)[0] == "relaunch"
    # later relaunches: the failed attempt wrote its first checkpoint 20 s after it started
    checkpoint(tmp_path, 8, T0 + 20)
    checkpoint(tmp_path, 4, T0 - 500)          # an earlier attempt's: not this one's
    record(tmp_path, 0, "retryable", T0 + 30, attempt=1, host="node2")     # node1 failed once only
    verdict, _, rec = decide(attempt(tmp_path, n=1, end=T0 + 30 + 19), now=T0 + 30)
    assert verdict == "stop" and rec["reason"] == ("19 s left in the allocation, fewer than the 20 s a relaunch "
                                                   "needs to reach its first checkpoint")
    assert decide(attempt(tmp_path, n=1, end=T0 + 30 + 21), now=T0 + 30)[0] == "relaunch"


def configured(run: Path, recipe: str) -> None:
    (run / "config.yaml").write_text(f"recipe: {recipe}\n")


@pytest.mark.parametrize("recipe, leaves_out", [("sasrec", True), ("kgat", False)])
def test_a_host_that_failed_twice_is_left_out_only_where_a_smaller_world_resumes_exactly(tmp_path, recipe, leaves_out):
    configured(tmp_path, recipe)
    record(tmp_path, 3, "running", T0, host="node2")
    assert decide(attempt(tmp_path), now=T0 + 1)[:2] == ("relaunch", [])
    record(tmp_path, 3, "running", T0 + 10, host="node2", attempt=1)
    verdict, exclude, rec = decide(attempt(tmp_path, n=1, start=T0 + 5), now=T0 + 11)
    if leaves_out:
        assert (verdict, exclude) == ("relaunch", ["node2"])
    else:
        assert verdict == "stop" and "does not resume exactly on a smaller world" in rec["reason"]


def test_a_host_that_failed_twice_in_a_one_node_allocation_stops_the_job(tmp_path):
    configured(tmp_path, "sasrec")
    for n in range(2):
        record(tmp_path, 0, "retryable", T0 + n, attempt=n)
        verdict, _, rec = decide(attempt(tmp_path, n=n, nodes=("node1",)), now=T0 + n + 0.5)
    assert verdict == "stop" and rec["reason"] == "host node1 failed 2 times and the allocation has no other node"


UNFIT = "UnfitHostError: pre-flight: unfit host(s) [node2]: node2: matmul 9.42 GFLOP/s, 0.23x the other hosts' median"


@pytest.mark.parametrize("recipe, checkpointed, leaves_out", [("kgat", False, True), ("sasrec", True, True),
                                                              ("kgat", True, False)])
def test_a_host_the_preflight_found_unfit_is_left_out_at_once(tmp_path, recipe, checkpointed, leaves_out):
    """At the first failure, not the second; every rank exits 5 but only the host named is left out. Before the
    first checkpoint any recipe starts on fewer ranks; after it, only one that resumes exactly on a smaller world."""
    configured(tmp_path, recipe)
    if checkpointed:
        checkpoint(tmp_path, 10, T0 - 50)
    for rank, host in enumerate(("node1", "node1", "node2", "node2")):
        record(tmp_path, rank, "unfit-host", T0 + 1, host=host, code=5, cause=UNFIT)
    verdict, exclude, rec = decide(attempt(tmp_path, rc=5), now=T0 + 2)
    if leaves_out:
        assert (verdict, exclude) == ("relaunch", ["node2"]) and rec["restart"] == 1    # it counts as a relaunch
    else:
        assert verdict == "stop" and rec["reason"].startswith("host node2 failed the pre-flight; without it")


def test_an_unfit_host_in_a_one_node_allocation_stops_the_job(tmp_path):
    configured(tmp_path, "sasrec")
    record(tmp_path, 0, "unfit-host", T0, host="node1", code=5,
           cause="UnfitHostError: pre-flight: unfit host(s) [node1]: node1: rank 0: a 64 MiB allocation failed")
    verdict, _, rec = decide(attempt(tmp_path, rc=5, nodes=("node1",)), now=T0 + 1)
    assert verdict == "stop"
    assert rec["reason"] == "host node1 failed the pre-flight and the allocation has no other node"


def test_summary_and_the_shell_line(tmp_path, capsys):
    record(tmp_path, 1, "running", T0, host="node2")
    checkpoint(tmp_path, 8, T0 - 5)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(dict(split="train", step=s, time=T0 - 10 + s)) + "\n" for s in range(1, 11))
        + json.dumps(dict(split="train", step=9, time=time.time() + 60)) + "\n")     # after the decision
    assert main(["decide", "--run-dir", str(tmp_path), "--rc", "137", "--attempt", "0", "--max", "2",
                 "--attempt-start", str(T0 - 20), "--job-start", str(T0 - 20), "--end-time", "",
                 "--nodes", "node1 node2", "--tasks-per-node", "2", "--job", JOB]) == 0
    out = capsys.readouterr()
    assert out.out == "relaunch\n" and "rank 1 on node2" in out.err and "relaunch 1 of 2" in out.err
    text = summary(tmp_path)
    assert "1 relaunch(es)" in text and "resumed from step 8; 2 step(s) recomputed" in text
    assert "from the failure to training again" in text     # the next train record after the decision


def test_the_batch_shell_can_say_stop_and_the_record_keeps_why(tmp_path):
    """slurm/common.sh passes --stop when the time-limit warning (USR1) came: the failure is still recorded."""
    record(tmp_path, 1, "retryable", T0 + 2, cause="RuntimeError: boom")
    a = attempt(tmp_path)
    a.stop = "the time-limit warning (USR1) came: no time for a relaunch"
    verdict, _, rec = decide(a, now=T0 + 3)
    assert verdict == "stop" and rec["reason"] == a.stop and rec["ranks"] == [1]

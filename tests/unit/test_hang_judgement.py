"""The hang watch's judgement (trainer/engine/components/hang_watch.py), with each rank's watch a real thread and a
shared board standing in for the rendezvous store: a stopped rank (its watch silent too) is named; a rank working
alone through a checkpoint or an evaluation is progress, not a hang; ranks all waiting with their watches alive name
the rank behind the others (its position in the engine's marks), every rank alike, or no rank when all stalled at
the same point. The end-to-end runs: tests/distributed/test_hang_watch.py (two ranks, one
SIGSTOPped) and tests/slurm/test_restart_loop.py (the restart loop relaunches it)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from trainer.distributed.heartbeats import Beat
from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import StepEnd
from trainer.engine.components.hang_watch import HangWatch, auto_timeout, blame
from trainer.launch.exitcodes import HANG

pytestmark = pytest.mark.timing     # real watch threads judged against short timeouts

PERIOD, TIMEOUT = 0.1, 1.2        # wide enough for a loaded 2-core machine (a live watch late by 0.6 s)


class Board:
    """The store's heartbeat keys, shared by the ranks' watches (a rank's watch stopped: it publishes nothing)."""

    def __init__(self):
        self.values: dict[int, str] = {}
        self.lock = threading.Lock()
        self.running = threading.Event()         # cleared: every watch stops at its next publish (the job suspended)
        self.running.set()
        self.stopped: set[int] = set()           # these ranks' watches stop at their next publish (SIGSTOP)
        self.posted, self.told = "", 0           # the group's verdict (the first posted), the ranks that recorded it

    def stop(self, rank: int) -> None:
        self.stopped.add(rank)

    def for_rank(self, rank: int):
        board = self

        class View:
            def publish(self, beat: Beat) -> None:
                board.running.wait()
                while rank in board.stopped:
                    time.sleep(1)
                with board.lock:
                    board.values[rank] = beat.encode()

            def read(self) -> dict[int, Beat]:
                with board.lock:
                    return {r: Beat.parse(v.encode()) for r, v in board.values.items()}

            def post_verdict(self, cause: str) -> str:
                with board.lock:
                    board.posted = board.posted or cause
                    return board.posted

            def verdict(self) -> str:
                return board.posted

            def told(self) -> int:
                with board.lock:
                    board.told += 1
                    return board.told

            def how_many_told(self) -> int:
                return board.told
        return View()


def watches(tmp_path, board: Board, n: int = 2, timeout: float = TIMEOUT):
    exits: dict[int, int] = {}
    made = [HangWatch(DistInfo(rank=r, world_size=n), tmp_path, timeout, board=board.for_rank(r), period_s=PERIOD,
                      exit_fn=lambda code, r=r: exits.__setitem__(r, code)) for r in range(n)]
    return made, exits


def step(watch: HangWatch, n: int) -> None:
    watch.step_end(StepEnd(epoch=0, micro=n, end=100, step=n, seconds=0.01, waited=0.0))


def started(tmp_path, board: Board | None = None):
    """Two ranks' watches, both past their first two steps (before that nothing is judged)."""
    (w0, w1), exits = watches(tmp_path, board or Board())
    for n in (1, 2):
        step(w0, n)
        step(w1, n)
    return w0, w1, exits


def wait_for(exits: dict, count: int) -> float:
    """Seconds until `count` ranks exited (at most ten timeouts)."""
    start = time.monotonic()
    while len(exits) < count and time.monotonic() - start < 10 * TIMEOUT:
        time.sleep(PERIOD)
    return time.monotonic() - start


def test_a_stopped_rank_is_named_by_its_silent_watch(tmp_path):
    board = Board()
    w0, w1, exits = started(tmp_path, board)
    time.sleep(5 * PERIOD)
    board.stop(1)                              # SIGSTOP: rank 1's watch stops with it; rank 0 waits in a collective
    took = wait_for(exits, 1)
    w0.close()
    assert exits == {0: HANG} and took < TIMEOUT + 10 * PERIOD
    text = (tmp_path / "hangs" / "rank-0.txt").read_text()
    assert text.startswith("hang: rank 1 ") and "its hang watch has been silent" in text
    assert "Thread" in text and "_watch" in text                   # every thread's stack
    record = json.loads((tmp_path / "exits" / "rank-0.json").read_text())
    assert (record["code"], record["kind"]) == (HANG, "hang") and record["cause"].startswith("hang: rank 1 ")


def test_one_rank_working_alone_through_a_checkpoint_or_an_evaluation_is_no_hang(tmp_path):
    w0, w1, exits = started(tmp_path)
    with w0.busy("checkpoint"):                # rank 0 writes for three timeouts; rank 1 waits at the broadcast
        time.sleep(3 * TIMEOUT)
    for _ in range(int(3 * TIMEOUT / 0.1)):    # an evaluation on rank 0 alone: a mark per batch
        w0.marked("evaluation batch", schedule=False)
        time.sleep(0.1)
    for w in (w0, w1):
        w.close()
    assert exits == {}


def test_ranks_all_waiting_with_their_watches_alive_name_the_rank_behind_every_one_alike(tmp_path):
    w0, w1, exits = started(tmp_path)
    time.sleep(3 * PERIOD)
    w0.marked("batch")                         # rank 0 got a batch further, then waits in a collective; rank 1 is
    wait_for(exits, 2)                         # stuck in Python (its watch alive)
    for w in (w0, w1):
        w.close()
    assert exits == {0: HANG, 1: HANG}
    for rank in (0, 1):                        # one verdict: every rank names rank 1
        text = (tmp_path / "hangs" / f"rank-{rank}.txt").read_text()
        assert text.startswith("hang: rank 1 made no progress") and "it is behind the others" in text, text


def test_ranks_all_stalled_at_the_same_point_blame_no_single_rank(tmp_path):
    w0, w1, exits = started(tmp_path)
    wait_for(exits, 2)
    for w in (w0, w1):
        w.close()
    assert exits == {0: HANG, 1: HANG}
    for rank in (0, 1):
        text = (tmp_path / "hangs" / f"rank-{rank}.txt").read_text()
        assert text.startswith("hang: the group made no progress") and "no single rank is to blame" in text, text


def test_a_silent_rank_is_named_even_while_another_works_through_a_long_phase(tmp_path):
    """Rank 0 in a recipe hook waiting on rank 1 inside it (KGAT's attention refresh gathers), rank 1 stopped: the
    long phase is progress, but a watch silent for the timeout is a hang."""
    board = Board()
    w0, w1, exits = started(tmp_path, board)
    with w0.busy("recipe.on_epoch_end"):
        board.stop(1)
        wait_for(exits, 1)
    w0.close()
    assert exits == {0: HANG}
    text = (tmp_path / "hangs" / "rank-0.txt").read_text()
    assert text.startswith("hang: rank 1 ") and "its hang watch has been silent" in text


def test_blame_is_one_rule_on_the_heartbeats():
    b = {0: Beat(10, 5, 7, "step 3: backward"), 1: Beat(9, 5, 6, "step 3: batch"), 2: Beat(10, 5, 7, "x")}
    assert blame(b, {}, 3)[0] == [1]
    assert blame(b, {2: 9.0}, 3)[0] == [2]                          # a silent watch before positions
    assert blame(b, {2: 9.0, 0: 8.0}, 3)[0] == [0, 2]
    same = {r: Beat(3, 5, 7, "checkpoint") for r in range(3)}
    named, why = blame(same, {}, 3)
    assert named == [] and "no single rank" in why and "checkpoint" in why
    assert blame({0: b[0], 1: b[1]}, {}, 2) == blame(dict(reversed(list({0: b[0], 1: b[1]}.items()))), {}, 2)


def test_a_suspended_job_is_judged_again_from_its_resumption_not_from_its_last_step(tmp_path, caplog):
    """`scontrol suspend` SIGSTOPs every rank, watches included; after `scontrol resume` every watch wakes to heartbeats
    seconds old. Judged on those, the whole job would exit 6 at once; a watch that finds its own loop was paused
    judges again from then."""
    board = Board()
    (w0, w1), exits = watches(tmp_path, board)
    for n in (1, 2):
        step(w0, n)
        step(w1, n)
    time.sleep(5 * PERIOD)
    board.running.clear()
    time.sleep(2.5)                            # suspended: longer than the timeout and than frozen_after_s()
    assert w0.frozen_after_s() < 2.5 and TIMEOUT < 2.5
    board.running.set()
    time.sleep(TIMEOUT / 2)                    # resumed: the steps in flight finish
    for n in range(3, 3 + int(2 * TIMEOUT / PERIOD)):
        step(w0, n)
        step(w1, n)
        time.sleep(PERIOD)
    for w in (w0, w1):
        w.close()
    assert exits == {}
    assert "the hang watch did not run for 3 s" in caplog.text or "did not run for 2 s" in caplog.text, caplog.text


def test_nothing_is_judged_before_this_rank_made_its_first_step(tmp_path):
    """Before its first step a rank may be compiling for minutes; after it, every rank has reached that step's
    collective. A rank stopped before its watch published a step is still named (the race issue 82 found)."""
    board = Board()
    (w0, w1), exits = watches(tmp_path, board)
    time.sleep(3 * TIMEOUT)                    # both compiling their first step
    assert exits == {}
    board.stop(1)                              # rank 1 stopped before its watch told of any step
    step(w0, 1)
    wait_for(exits, 1)
    w0.close()
    assert exits == {0: HANG}


def test_the_automatic_timeout_is_a_minute_or_twenty_of_the_slowest_steps():
    assert auto_timeout(0.5) == 60.0 and auto_timeout(6.0) == 120.0


def test_a_rank_whose_run_ended_is_not_taken_for_a_stopped_one(tmp_path):
    """Rank 1 closed its run (its watch's last beat says so) while rank 0 still works through its last phases."""
    w0, w1, exits = started(tmp_path)
    w1.close()
    with w0.busy("recipe.after_evaluation"):
        time.sleep(3 * TIMEOUT)
    w0.close()
    assert exits == {}


def test_shards_of_unequal_length_do_not_put_a_rank_behind(tmp_path):
    """An evaluation's shards may differ by a batch: its batches are progress, not schedule. Ranks that then stall at
    the same point are the group's hang, not the rank with the shorter shard's."""
    w0, w1, exits = started(tmp_path)
    for n in range(3):
        w0.marked("evaluation batch", schedule=False)
        if n < 2:
            w1.marked("evaluation batch", schedule=False)
    for w in (w0, w1):
        w.marked("evaluation done")
    wait_for(exits, 2)
    for w in (w0, w1):
        w.close()
    assert "hang: the group made no progress" in (tmp_path / "hangs" / "rank-0.txt").read_text()

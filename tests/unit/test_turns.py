"""tests/cluster.py's turns, which the suite's workers take around each test (tests/conftest.py): tests marked
one_at_a_time(NAME) never overlap; tests on the cluster overlap unless one is marked cluster_alone; a test marked
timing(machine=True) overlaps no other; a timing test runs in a CPU share of its own (tests/slowing.py
timing_share). Two threads here stand for two workers: each opens the lock files itself, and flock locks of two open
files exclude each other as two processes' do; the lock files are this test's own (tempfile's folder pointed at
tmp_path), apart from those the suite's workers hold around it."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests import slowing
from tests.cluster import cluster_turn, machine_turn, named_turns


class Marked:
    """What the turns read of a pytest item: its markers."""

    def __init__(self, *marks: pytest.MarkDecorator):
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str):
        return (m for m in self.marks if m.name == name)

    def get_closest_marker(self, name: str):
        return next(self.iter_markers(name), None)


def spans(turn, first: Marked, second: Marked, hold_s: float = 0.4) -> list[tuple[float, float]]:
    """Each of two threads takes its item's turn and holds it hold_s: when each was inside."""
    inside: list[tuple[float, float]] = []

    def run(item, delay):
        time.sleep(delay)
        with turn(item):
            began = time.monotonic()
            time.sleep(hold_s)
            inside.append((began, time.monotonic()))
    threads = [threading.Thread(target=run, args=(item, delay)) for item, delay in ((first, 0), (second, 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(inside) == 2
    return sorted(inside)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.fixture(autouse=True)
def own_locks(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_tests_of_one_name_take_turns_and_other_names_do_not_wait(tmp_path):
    video = Marked(pytest.mark.one_at_a_time("video-defaults"))
    assert not overlap(*spans(named_turns, video, video))
    assert (tmp_path / "hpc-trainer-turn-video-defaults.lock").exists()         # this test's own lock
    assert overlap(*spans(named_turns, video, Marked(pytest.mark.one_at_a_time("netns-cluster"))))
    assert overlap(*spans(named_turns, video, Marked()))          # an unmarked test waits for nothing


def test_tests_on_the_cluster_share_it_but_one_marked_alone_has_it_to_itself():
    shared, alone = Marked(pytest.mark.slurm), Marked(pytest.mark.slurm, pytest.mark.cluster_alone)
    assert overlap(*spans(cluster_turn, shared, shared))
    assert not overlap(*spans(cluster_turn, shared, alone))
    assert not overlap(*spans(cluster_turn, alone, shared))
    assert overlap(*spans(cluster_turn, alone, Marked()))         # a test off the cluster takes no turn there


def test_a_test_that_needs_the_machine_has_it_to_itself_and_the_others_share_it():
    whole = Marked(pytest.mark.timing(machine=True))
    for other in (Marked(), Marked(pytest.mark.timing), Marked(pytest.mark.slurm)):
        assert overlap(*spans(machine_turn, other, other))
        assert not overlap(*spans(machine_turn, other, whole))
        assert not overlap(*spans(machine_turn, whole, other))


@pytest.mark.parametrize("mark", [pytest.mark.timing, pytest.mark.timing(machine=True)], ids=["timing", "machine"])
def test_a_timing_test_and_what_it_starts_run_in_a_cpu_share_of_their_own(mark):
    """tests/slowing.py timing_share: inside, this process and a child it starts are in a group of the test's
    weight; after, this process is back where it was and the group is gone; an unmarked test stays where it is."""
    if (reason := slowing.quota_reason()) is not None:
        print(f"SKIP: {reason}: no cpu share to give")
        pytest.skip(reason)
    cpu_group = slowing._cgroup_of
    home = cpu_group(os.getpid())
    with slowing.timing_share(Marked()):
        assert cpu_group(os.getpid()) == home
    with slowing.timing_share(Marked(mark)):
        group = cpu_group(os.getpid())
        assert group.name == f"hpc-trainer-timing-{os.getpid()}"
        assert int((group / "cpu.shares").read_text()) == slowing.TIMING_SHARES
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        assert cpu_group(child.pid) == cpu_group(os.getpid())
    try:
        assert cpu_group(os.getpid()) == home and not group.exists()
        assert cpu_group(child.pid) == slowing.CPU_CGROUP    # a leftover goes to the root group, not the removed one
    finally:
        child.kill()
        child.wait()

"""Issue 82 point 5: the kernels' build announces the time the last build of them took on this cache, or no number
(a build of 561 s niced on a loaded 2-core machine was announced as "about a minute")."""
from __future__ import annotations

from trainer.native import background


def test_no_build_measured_here_names_no_number(tmp_path):
    assert background.last_build_s(tmp_path) is None
    assert background.last_build_s(tmp_path, ["trainer_shm_allreduce-native"]) is None


def test_the_last_builds_measured_here_are_the_estimate(tmp_path):
    background.record_build(tmp_path, "trainer_shm_allreduce-native", 12.34)
    background.record_build(tmp_path, "trainer_cpu_kernels-native", 80.0)
    background.record_build(tmp_path, "trainer_cpu_kernels-portable", 500.0)
    assert background.last_build_s(tmp_path, ["trainer_shm_allreduce-native"]) == 12.3
    assert background.last_build_s(tmp_path) == 92.3                       # the background builder's: every native
    assert background.last_build_s(tmp_path, ["trainer_shm_allreduce-native", "never-built-native"]) is None
    background.record_build(tmp_path, "trainer_cpu_kernels-native", 561.0)  # the newest replaces the older
    assert background.last_build_s(tmp_path) == 573.3


def test_a_damaged_record_is_no_estimate(tmp_path):
    (tmp_path / background.TIMES).write_text("{not json")
    assert background.last_build_s(tmp_path) is None
    background.record_build(tmp_path, "x-native", 3.0)
    assert background.last_build_s(tmp_path) == 3.0

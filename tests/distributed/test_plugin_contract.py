"""Issue 83 point 2: a new concern written outside the package, as a user would, through the public contract only:
tests/plugins/tally, installed with pip into a folder of its own and found by its entry point (no TRAINER_PLUGINS
entry for it). It adds a config section set as tally.KEY=VALUE, stops the run with its own reason and exit code, and
keeps its state (a generator of its own, a sum) bitwise across the resume; the engine is not edited for it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import PY, REPO, assert_bitwise_equal, clean_env, weights
from tests.timeouts import limit

TOY = ("train", "--recipe", "toy", "--seed", "5", "--epochs", "3", "log.tensorboard=false")   # 8 steps an epoch


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """The plugin pip-installed (no index, no build isolation: this venv's setuptools) into a folder on PYTHONPATH,
    from a copy (a build leaves build/ and *.egg-info beside its sources: none in the repository)."""
    target, source = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("src") / "tally"
    shutil.copytree(REPO / "tests" / "plugins" / "tally", source)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=limit("long"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(target.glob("trainer_tally-*.dist-info/entry_points.txt")), list(target.iterdir())
    return clean_env(PYTHONPATH=f"{REPO}:{target}")


def train(env, run_dir, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "trainer", *TOY, "--run-dir", str(run_dir), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=limit("long"))


def test_a_pip_installed_plugin_stops_with_its_own_code_and_resumes_its_state_bitwise(tmp_path, plugin_env):
    ref = train(plugin_env, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    through = json.loads((tmp_path / "ref" / "tally.json").read_text())
    assert through["steps"] == 24

    run = tmp_path / "run"
    stopped = train(plugin_env, run, "tally.stop_at=12", "tally.code=70")
    assert stopped.returncode == 70, stopped.stderr[-3000:]
    assert "tally: stopped at step 12 as tally.stop_at asks" in stopped.stderr
    assert (run / "checkpoints" / "step-00000012.pt").exists() and not (run / "checkpoints" / "final.pt").exists()
    record = json.loads((run / "exits" / "rank-0.json").read_text())
    assert record["code"] == 70 and "tally: stopped at step 12" in record["cause"], record
    assert json.loads((run / "tally.json").read_text())["steps"] == 12

    resumed = train(plugin_env, run, "tally.stop_at=12", "tally.code=70", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "tally.json").read_text()) == through       # its generator and sum came back
    assert_bitwise_equal(weights(run), weights(tmp_path / "ref"))


def test_the_plugins_section_is_a_config_section_like_any_other(tmp_path, plugin_env):
    typo = train(plugin_env, tmp_path / "typo", "tally.stopat=3")
    assert typo.returncode == 2 and "Did you mean 'tally.stop_at'?" in typo.stderr, typo.stderr[-2000:]
    bad = train(plugin_env, tmp_path / "bad", "tally.code=200")
    assert bad.returncode == 2 and "tally.code = 200 is out of range" in bad.stderr, bad.stderr[-2000:]
    shown = subprocess.run([PY, "-m", "trainer", *TOY, "--print-config"], cwd=REPO, env=plugin_env,
                           capture_output=True, text=True, timeout=limit("run"))
    assert shown.returncode == 0 and "tally:\n  stop_at: 0\n  code: 70" in shown.stdout, shown.stdout[-2000:]
    assert not (tmp_path / "typo").exists() and not (tmp_path / "bad").exists()

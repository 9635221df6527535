"""Issue 19.9: PyAV (video only) and submitit (submission only) are optional extras; without them the other
recipes train, and what needs them stops with the pip command that installs them."""
from __future__ import annotations

import re
import subprocess

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit

BLOCK = "import sys; sys.modules['av'] = None; sys.modules['submitit'] = None\n"   # as if not installed


def run_without_extras(code: str, tmp_path):
    return subprocess.run([PY, "-c", BLOCK + code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=limit("long"))


def test_the_core_install_pulls_neither_av_nor_submitit():
    pyproject = (REPO / "pyproject.toml").read_text()
    core = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    assert "av" not in re.findall(r'"([a-z-]+)', core) and "submitit" not in core
    assert re.search(r'^video = \["av', pyproject, re.M) and re.search(r'^submit = \["submitit', pyproject, re.M)


def test_har_trains_without_the_extras_and_video_names_its_extra(tmp_path):
    main = "from trainer.cli import main; sys.exit(main({argv!r}))"
    har = run_without_extras(main.format(argv=["train", "--recipe", "har", "--epochs", "1", "--run-dir",
                                               str(tmp_path / "har"), "data.synthetic_cases=120",
                                               "model.width=8", "log.tensorboard=false"]), tmp_path)
    assert har.returncode == 0, har.stderr[-2000:]
    assert (tmp_path / "har" / "checkpoints" / "final.pt").exists()
    video = run_without_extras(main.format(argv=["data", "synth", "video", "--out", str(tmp_path / "v")]), tmp_path)
    assert video.returncode == 2 and "pip install 'hpc-trainer[video]'" in video.stderr, video.stderr[-2000:]
    assert "Traceback" not in video.stderr


def test_submit_without_submitit_names_its_extra(tmp_path):
    code = ("import runpy; sys.argv = ['hpc/submit.py', '--recipe', 'har', '--dry-run', '--folder', "
            f"'{tmp_path / 'sub'}', 'data.synthetic=true']\nrunpy.run_path('hpc/submit.py', run_name='__main__')")
    proc = run_without_extras(code, tmp_path)
    assert proc.returncode == 2 and "pip install 'hpc-trainer[submit]'" in proc.stderr, proc.stderr[-2000:]

"""docs/extending.md ("How to add a recipe"), followed literally: its files are written to a scratch folder and its
commands run there. A fifth recipe gets train, eval, data synth and a bench preset without any file of the
repository changing."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.conftest import REPO, clean_env
from tests.timeouts import limit
from trainer.engine.logging import read_metrics


def readme_section() -> str:
    return (REPO / "docs" / "extending.md").read_text()


def blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_readme_recipe_folder_trains_evaluates_synthesizes_and_benches(tmp_path):
    section = readme_section()
    files = blocks(section, "python")
    assert len(files) == 4, "the section shows config.py, recipe.py, data.py and spec.py"
    for code in files:
        name = re.match(r"# (\S+\.py)", code).group(1)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    before = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    script = blocks(section, "bash")
    assert len(script) == 1
    env = clean_env(REPO=str(REPO), PATH=f"{Path(os.sys.executable).parent}:{os.environ['PATH']}")
    env.pop("TRAINER_PLUGINS")
    out = subprocess.run(["bash", "-euxc", script[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=limit("jobs"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = (tmp_path / "data/tinyreg/points.csv").read_text().splitlines()
    assert len(rows) == 400                                     # data synth tinyreg --points 400
    val = read_metrics(tmp_path / "runs/tinyreg", "val")
    assert len(val) == 4 and val[-1]["mse"] < val[0]["mse"]     # it learns
    evaluated = json.loads((tmp_path / "runs/tinyreg/eval.json").read_text())
    assert evaluated["test"]["mse"] < 0.5                        # `trainer eval` of the run directory
    assert evaluated["checkpoint"].endswith("runs/tinyreg/checkpoints/best.pt")    # its best, named
    assert re.search(r"^mse\s+[\d.]+\s+[\d.]+$", out.stdout, re.M)             # the terminal's table
    bench = json.loads((tmp_path / "runs/bench-tinyreg/tinyreg-torchrun-w1.json").read_text())
    assert bench["recipe"] == "tinyreg" and bench["batch_per_rank"] == 32 and bench["samples_per_s"] > 0
    after = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    assert after == before, "adding a recipe changed files of the repository"

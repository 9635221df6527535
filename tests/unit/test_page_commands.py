"""Issue 86 point 4: every command of the README and the guides runs in the tests, as a user types it. Here: the
ones this machine can run (in a sandbox laid out as the repository root with data of every format the pages name,
each training budgeted to 2 steps: tests/pages.py), in page order, so that a page's eval finds its train's run;
the cluster's commands build their jobs here (hpc/submit.py --dry-run, the sbatch scripts' syntax and arguments)
and run on the local cluster in tests/slurm/test_page_commands_on_cluster.py; the GPU's in
tests/gpu/test_page_commands_cuda.py; downloads and installs are checked against what they fetch (the registry),
never fetched."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.pages import PageCommand, bare_fences, page_commands, pages, run_here, sandbox
from tests.procs import REPO, clean_env

COMMANDS = page_commands()
# make's targets are checked by what they run (the table below), not run from inside the suite
HERE = [c for c in COMMANDS if not c.needs and c.program != "make"]
# pages whose commands a test of their own runs literally, block by block
RUN_ELSEWHERE = {"docs/extending.md": "tests/unit/test_add_recipe.py"}
# make targets a page names -> (what the target's recipe runs, the file that runs the same, what it says there)
MAKE_TARGETS = {
    "demo": ("-m trainer.cli.demo", "tests/recipes/test_demo.py", '"trainer.cli.demo"'),
    "test": ("tests/run.sh", ".ci/run", "make test"),
    "test-fast": ('-m "not slurm and not image and not long and not timing"', "pyproject.toml",
                  "make test-fast leaves it out"),
    "slurm-up": ("hpc/cluster/start.sh", "tests/conftest.py", '"hpc/cluster/start.sh"'),
    "slurm-down": ("hpc/cluster/stop.sh", "tests/conftest.py", '"hpc/cluster/stop.sh"'),
    "slurm-env": ("hpc/cluster/where.sh", "tests/slurm/test_page_commands_on_cluster.py", "make -s slurm-env"),
    "test-under-load": ("tests/under_load.sh", "tests/under_load.sh", "-m timing"),
    "bench-gpu": ("-m bench.gpu", "bench/gpu_check.sh", "-m bench.gpu"),
    "image": ("docker build", "docker/standin/build.sh", "podman build"),
    "sif": ("apptainer build", "tests/container/test_images.py", "apptainer.def"),
}


def test_the_pages_have_commands_and_no_block_hides_one():
    assert len(COMMANDS) > 50 and len(HERE) > 25
    bare = {p.relative_to(REPO).as_posix(): bare_fences(p) for p in pages()}
    assert {p: lines for p, lines in bare.items() if lines} == {}, "a fence without a kind (```text, ```bash, ...)"


def test_what_a_command_needs_is_read_from_its_words():
    from tests.pages import needs_of
    assert needs_of("sbatch slurm/x.sbatch", set()) == {"cluster"}
    assert needs_of("DATA=d sbatch slurm/x.sbatch", set()) == {"cluster"}
    assert needs_of("python hpc/submit.py --recipe toy", set()) == {"cluster"}
    assert needs_of("python hpc/submit.py --recipe toy --cluster local", set()) == set()
    assert needs_of("docker run --gpus all img python -m trainer doctor", {"gpu"}) == {"container", "gpu"}
    assert needs_of("python -m trainer data download ml-100k --out data/", set()) == {"network"}
    assert needs_of("pip install 'hpc-trainer[mlflow]'", set()) == {"network"}
    assert needs_of("python -m trainer train --recipe toy", set()) == frozenset()


def test_every_command_is_one_the_tests_know_how_to_run():
    known = {"trainer", "submit", "bench", "torchrun", "make", "cat", "export", "sbatch", "srun", "salloc", "eval",
             "docker", "apptainer", "pip"}
    unknown = [c.where + " " + c.text for c in COMMANDS if c.program not in known]
    assert unknown == []


def test_every_make_target_a_page_names_exists_and_is_run_by_the_tests():
    makefile = (REPO / "Makefile").read_text()
    for c in (c for c in COMMANDS if c.program == "make" or "make " in c.text):
        target = re.search(r"make (?:-s )?([a-z][\w-]*)", c.text).group(1)
        assert target in MAKE_TARGETS, f"{c.where}: make {target}: which test runs it?"
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe, f"{c.where}: the Makefile has no target {target}"
        runs, where, said = MAKE_TARGETS[target]
        assert runs in recipe.group(1), (target, recipe.group(1))
        assert said in (REPO / where).read_text(), f"make {target}: {where} does not run it"


def test_what_a_download_or_an_install_would_fetch_is_registered():
    from trainer.data.download import registered
    known = registered()
    extras = (REPO / "pyproject.toml").read_text()
    for c in (c for c in COMMANDS if "network" in c.needs):
        words = c.env_and_argv()[1]
        if "download" in words:
            name = words[words.index("download") + 1]
            assert name in known, f"{c.where}: {name} is not a dataset the trainer downloads"
        elif words[0] == "pip":
            extra = re.search(r"\[(\w+)\]", c.text).group(1)
            assert re.search(rf"^{extra} = \[", extras, re.M), f"{c.where}: no extra {extra}"
        else:                                        # a command that reaches a server: all but that, here
            assert re.search(r"https?://", c.text), c.where


# the recipes page trains video at its defaults (~6 GB a process): with the hang watch's video rows, one at a time
BIG = {"docs/recipes.md": pytest.mark.one_at_a_time("video-defaults")}


@pytest.mark.long     # every command of a page, trainings included: make test-fast leaves it out
@pytest.mark.parametrize("page", [pytest.param(p, marks=BIG.get(p, ())) for p in sorted({c.page for c in HERE})])
def test_a_pages_commands_run_here_in_order(page, tmp_path, page_data):
    if page in RUN_ELSEWHERE:
        text = (REPO / RUN_ELSEWHERE[page]).read_text()
        assert page in text and "blocks(section, \"bash\")" in text, f"{RUN_ELSEWHERE[page]} runs {page}'s commands"
        return
    work = sandbox(tmp_path, page_data)
    env = clean_env()
    env.pop("TRAINER_PLUGINS")                       # a user's shell: no test recipe
    from tests.inprocess import cli
    cli("train", "--recipe", "sasrec", "--run-dir", "runs/example", "train.max_steps=2", env=env, cwd=work)
    failed = []
    for command in (c for c in HERE if c.page == page):
        code, out = run_here(command, work, env)
        trains = " train " in f" {command.text} " and "--print-config" not in command.text
        trained = "training completed" in out or not trains
        if code != 0 or not trained:
            failed.append(f"{command.where}: {command.text}\n  exit {code}: {out[-1500:]}")
    assert failed == [], "\n".join(failed)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "submit"], ids=lambda c: c.where)
def test_a_submit_command_of_the_pages_builds_its_job_here(command: PageCommand, tmp_path, page_data):
    """hpc/submit.py's commands need a cluster to run; --dry-run checks all but the submission: the flags, the
    config and its overrides, the search space, the batch script."""
    work = sandbox(tmp_path, page_data)
    (work / "hpc-trainer.sif").write_bytes(b"")       # the image `make sif` builds: only its name is checked here
    dry = PageCommand(command.page, command.line, command.text + " --dry-run", frozenset())
    code, out = run_here(dry, work, clean_env())
    assert code == 0, f"{command.where}: {command.text}\n{out[-2000:]}"
    assert "# task: python -m trainer" in out and ("#SBATCH" in out or "--cluster" in command.text)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.program == "sbatch"], ids=lambda c: c.where)
def test_an_sbatch_command_of_the_pages_names_a_script_that_parses_and_arguments_the_trainer_takes(command):
    env, argv = command.env_and_argv()
    script = next(w for w in argv if w.endswith(".sbatch"))
    assert (REPO / script).is_file(), f"{command.where}: {script}"
    syntax = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    unknown = set(env) - set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", (REPO / "slurm/common.sh").read_text()
                                        + (REPO / script).read_text()))
    assert unknown == set(), f"{command.where}: knobs the scripts do not read: {unknown}"
    after = argv[argv.index(script) + 1:]
    if after and not script.endswith("predict.sbatch"):        # they go to `trainer train`: parsed as it parses them
        from trainer.cli.parser import get_parser
        get_parser().parse_args(["train", *after])


def test_the_helpers_cli_takes_a_working_directory(tmp_path):
    from tests.inprocess import cli
    ran = cli("train", "--recipe", "toy", "--epochs", "1", "--run-dir", "here", cwd=tmp_path)
    assert ran.returncode == 0 and (tmp_path / "here" / "checkpoints").is_dir()
    assert not (REPO / "here").exists()

"""Issue 86 point 4, the cluster's part: the commands of the README and the guides that need Slurm (sbatch, srun,
salloc, hpc/submit.py; tests/pages.py reads which), on the local cluster, in a sandbox laid out as the repository
root with the data each names (tests/pages.py).

Every one is put to the scheduler as written, its CPUs per task fitted to the local nodes' 4 (`--cpus-per-task=1`):
sbatch, srun and salloc with `--test-only` (Slurm checks the script, the shape, the partition and the time and says
when the job would start), hpc/submit.py through the batch script its --dry-run prints. The README's, the front
door, run for real, side by side, each training budgeted to 2 steps, and must end well: the jobs complete, the
search's trials are told to its study and `trainer runs` tables them; so do docs/cluster.md's sweeps, in order,
with their tables and the rerun of two points, and its tasks without a scheduler. The guides' other sbatch scripts
run for real in tests/slurm/test_sbatch.py and test_submit_on_cluster.py."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import slurm_env
from tests.pages import PageCommand, budgeted, filled, page_commands, run_here, sandbox
from tests.timeouts import limit

pytestmark = pytest.mark.slurm

# make slurm-up and slurm-down: what the slurm_cluster fixture runs (tests/unit/test_page_commands.py's table)
ON_CLUSTER = [c for c in page_commands() if "cluster" in c.needs and not c.needs & {"gpu", "container", "network"}
              and c.program != "make"]
LAUNCHERS = ("sbatch", "srun", "salloc")
# the search's trials, budgeted as its trainings are: 3 trials in one wave of the array
TRIALS = ("--trials", "3")


def fitted(argv: list[str]) -> list[str]:
    """A launcher's words with its CPUs per task fitted to the local nodes (4 CPUs each): the page's GPUs, tasks and
    nodes stay as written."""
    argv = [w for w in argv if not w.startswith("--cpus-per-task")]
    return [argv[0], "--cpus-per-task=1", *argv[1:]]


def cluster_env(conf: Path, work: Path) -> dict[str, str]:
    """A user's shell on the cluster: no test recipe, the environment's python first on PATH (`python` on the
    nodes is this one), pointed at the local cluster."""
    env = slurm_env(conf, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("TRAINER_PLUGINS")
    return env


def scheduler_answer(command: PageCommand, work: Path, env: dict[str, str]) -> str:
    """The scheduler's answer to the command as written (--test-only), or the failure it reports."""
    own, argv = command.env_and_argv()
    argv = filled(argv)
    if command.program == "submit" or (command.program == "trainer" and "runs" in argv[3:4]):
        if command.program == "trainer":
            return "sbatch: a table of finished runs (run for real where its jobs do)"
        dry = PageCommand(command.page, command.line, command.text + " --dry-run", frozenset())
        code, out = run_here(dry, work, env)
        assert code == 0, f"{command.where}: --dry-run: {out[-2000:]}"
        if "--cluster" in command.text:
            return "sbatch: local tasks, no scheduler"
        script = work / "page-dry-run.sbatch"
        script.write_text(out[out.index("#!"):] if "#!" in out else out)
        argv = ["sbatch", str(script)]
    if argv[0] == "eval":                             # eval "$(make -s slurm-env)": what it would export
        out = subprocess.run(["make", "-s", "slurm-env"], cwd=work, env=env, capture_output=True, text=True)
        assert f"export SLURM_CONF={env['SLURM_CONF']}" in out.stdout, out.stdout + out.stderr
        return "sbatch: exports this cluster's SLURM_CONF"
    launcher = fitted(argv)
    launcher.insert(1, "--test-only")
    if launcher[0] == "srun":                         # srun --test-only takes the step's shape, not its command
        launcher = launcher[:next(i for i, w in enumerate(launcher) if i and not w.startswith("-"))]
    if launcher[0] == "salloc":                       # salloc has no --test-only: sbatch's, same allocation options
        launcher = ["sbatch", *launcher[1:], "--wrap=true"]
    proc = subprocess.run(launcher, cwd=work, env=dict(env, **own), capture_output=True, text=True,
                          timeout=limit("run"))
    return proc.stdout + proc.stderr


def test_every_cluster_command_of_the_pages_is_one_the_scheduler_would_start(slurm_cluster, tmp_path, page_data):
    assert len(ON_CLUSTER) > 25
    work = sandbox(tmp_path, page_data)
    env = cluster_env(slurm_cluster, work)
    refused = {}
    for command in ON_CLUSTER:
        answer = scheduler_answer(command, work, env)
        if not re.search(r"(sbatch|srun|salloc): (Job \d+ to start at|a table|local tasks|exports)", answer):
            refused[command.where] = f"{command.text}\n  {answer.strip()[-600:]}"
    assert refused == {}, "\n".join(f"{k}: {v}" for k, v in refused.items())


def real_argv(command: PageCommand) -> list[str]:
    """What a user's terminal would run, waiting for the job's end: sbatch --wait, hpc/submit.py --follow."""
    argv = budgeted(filled(command.env_and_argv()[1]))
    if argv[0] in LAUNCHERS:
        argv = fitted(argv)
        if argv[0] == "sbatch":
            argv.insert(1, "--wait")
    elif command.program == "submit":
        argv = [sys.executable, *argv[1:], "--follow"]
        if "--trials" in argv:
            at = argv.index("--trials")
            argv[at:at + 2] = TRIALS
    return argv


def test_the_readmes_cluster_commands_run_on_the_cluster_and_end_well(slurm_cluster, tmp_path, page_data):
    front = [c for c in ON_CLUSTER if c.page == "README.md" and c.program != "trainer"]    # runs: after them
    assert {c.program for c in front} >= {"sbatch", "srun", "submit"}
    work = sandbox(tmp_path, page_data)
    env = cluster_env(slurm_cluster, work)
    started = [(c, subprocess.Popen(real_argv(c), cwd=work, env=dict(env, **c.env_and_argv()[0]), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)) for c in front]
    failed = []
    for command, proc in started:
        try:
            out, _ = proc.communicate(timeout=limit("jobs"))
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        if proc.returncode != 0:
            failed.append(f"{command.where}: {command.text}\n  exit {proc.returncode}: {out[-1500:]}")
    assert failed == [], "\n".join(failed)
    logs = {p.name: p.read_text() for p in work.glob("*.out")}
    assert sum("training completed" in text for text in logs.values()) >= 2, sorted(logs)
    # the search's trials, then `python -m trainer runs runs/sasrec-search` as the README has it after them
    table = [c for c in page_commands() if c.page == "README.md" and c.text.startswith("python -m trainer runs")]
    code, out = run_here(table[0], work, env)
    assert code == 0 and out.count("complete") + out.count("pruned") == int(TRIALS[1]), out


def test_the_cluster_guides_sweeps_run_on_the_cluster_and_their_tables_read_them(slurm_cluster, tmp_path, page_data):
    """docs/cluster.md's researcher's loop as written, in order, on the local cluster: each sweep submitted and
    followed to its end, `trainer runs` on its folder (every point completed), the points submitted again
    (`--sweep-points`: each resumes and ends), and the same tasks without a scheduler (`--cluster local|debug`)."""
    guide = [c for c in ON_CLUSTER if c.page == "docs/cluster.md"]
    swept = {c.words()[c.words().index("--run-dir") + 1] for c in guide if "--sweep" in c.text}
    loop = [c for c in guide if "--sweep" in c.text or "--cluster " in c.text
            or re.fullmatch(r"python -m trainer runs (\S+)", c.text) and c.words()[-1] in swept]
    assert sum("--sweep-points" in c.text for c in loop) == 1 and sum("--cluster " in c.text for c in loop) == 2
    work = sandbox(tmp_path, page_data)
    env = cluster_env(slurm_cluster, work)
    points = {}
    for command in loop:
        if command.program == "trainer":                 # the table of the sweep the block just ran
            code, out = run_here(command, work, env)
            folder = command.words()[-1]
            assert code == 0 and out.count("completed") == points[folder], f"{command.where}:\n{out}"
            continue
        proc = subprocess.run(real_argv(command), cwd=work, env=env, capture_output=True, text=True,
                              timeout=limit("jobs"))
        assert proc.returncode == 0, f"{command.where}: {command.text}\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
        argv = command.words()
        if "--sweep" in argv and "--sweep-points" not in argv:
            grid = [len(argv[i + 1].split("=", 1)[1].split(",")) for i, w in enumerate(argv) if w == "--sweep"]
            points[argv[argv.index("--run-dir") + 1]] = math.prod(grid)
    assert len(points) == 2, points

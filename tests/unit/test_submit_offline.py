"""hpc/submit.py without a cluster: time and GRES parsing, sweeps, argv round trip, dry-run golden file."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpc import submit
from hpc.slurm_info import SubmitError, gres_gpus, parse_time_min
from hpc.task import TrainTask
from tests.conftest import PY, REPO, clean_env, record_fault
from tests.inprocess import entry
from tests.timeouts import limit

GOLDEN = REPO / "tests" / "golden"


@pytest.mark.parametrize("text,minutes", [("30", 30), ("1:30", 2), ("01:00:00", 60), ("2-00", 2880),
                                          ("1-02:03", 1563), ("0-00:00:59", 1), ("00:10:00", 10)])
def test_parse_time(text, minutes):
    assert parse_time_min(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "00:00:00", "-5"])
def test_parse_time_rejects(text):
    with pytest.raises(SubmitError, match="--time"):
        parse_time_min(text)


@pytest.mark.parametrize("gres,n", [("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("gpu:2,shard:8", 2),
                                    ("(null)", 0), ("gpu:a100:2,gpu:v100:2", 4), ("mps:100", 0)])
def test_gres_gpus(gres, n):
    assert gres_gpus(gres) == n


def test_sweep_product_and_names():
    combos = submit.parse_sweeps(["optim.lr=0.1,0.01", "model.hidden=8,16"])
    assert combos == [["optim.lr=0.1", "model.hidden=8"], ["optim.lr=0.1", "model.hidden=16"],
                      ["optim.lr=0.01", "model.hidden=8"], ["optim.lr=0.01", "model.hidden=16"]]
    assert submit.combo_name(0, combos[0]) == "000-optim.lr-0.1_model.hidden-8"
    assert submit.parse_sweeps([]) == [[]]
    for bad in (["optim.lr"], ["=1,2"], ["optim.lr="]):
        with pytest.raises(SubmitError, match="--sweep"):
            submit.parse_sweeps(bad)


def parse(*argv):
    from trainer.cli.parser import parse_args
    return parse_args(submit.get_parser(), list(argv))


def test_trainer_argv_round_trips_through_the_trainer_parser(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_PLUGINS", "tests.toy_recipe")
    args = parse("--recipe", "sasrec", "--epochs", "3", "--lr", "0.01", "--gpu-ids", "0,1", "--amp", "bf16",
                 "--nodes", "2", "model.hidden=8", "--gpus-per-node", "4", "train.batch_size=16")
    argv = submit.trainer_argv(args, tmp_path / "run", ["model.blocks=1"])
    from trainer.cli.parser import flags_from_args, get_parser, parse_args
    back = parse_args(get_parser(), ["train", *argv])
    assert back.recipe == "sasrec" and back.run_dir == str(tmp_path / "run") and back.resume == "auto"
    expected = dict(flags_from_args(args), run_dir=str(tmp_path / "run"), **{"ckpt.resume": "auto"})
    assert flags_from_args(back) == expected
    assert back.overrides == ["model.hidden=8", "train.batch_size=16", "model.blocks=1"]


def test_one_task_per_gpu_and_conflicts():
    assert submit.tasks_per_node(parse("--recipe", "sasrec", "--gpus-per-node", "4")) == 4
    assert submit.tasks_per_node(parse("--recipe", "sasrec", "--tasks-per-node", "3")) == 3
    assert submit.tasks_per_node(parse("--recipe", "sasrec")) == 1
    with pytest.raises(SubmitError, match="one task per GPU"):
        submit.tasks_per_node(parse("--recipe", "sasrec", "--gpus-per-node", "4", "--tasks-per-node", "2"))


def test_checkpoint_resumes_the_same_run():
    task = TrainTask(["--recipe", "toy", "--run-dir", "/r", "--resume", "/old/step.pt", "optim.lr=1"])
    delayed = task.checkpoint()
    assert delayed.function.argv == ["--recipe", "toy", "--run-dir", "/r", "optim.lr=1", "--resume", "auto"]
    assert delayed.function.checkpoint().function.argv.count("--resume") == 1


def dry_run(*argv, env=None):
    """hpc/submit.py ARGV through its entry (hpc.submit.main) in this process, answering as its process would
    (that --help and --dry-run import no torch is tests/unit/test_structure.py's, in a process of its own)."""
    return entry(submit.main, argv, env=env, check=False)


def normalise(text: str) -> str:
    return text.replace(shlex.quote(sys.executable), "<PYTHON>").replace(str(REPO), "<REPO>")


def test_dry_run_matches_golden_file():
    proc = dry_run("--recipe", "toy", "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "2",
                   "--mem", "32G", "--time", "02:30:00", "--partition", "debug", "--account", "lab",
                   "--qos", "normal", "--job-name", "golden", "--exclusive", "--folder", "/jobs/submitit",
                   "--run-dir", "/runs/golden", "--dry-run", "--epochs", "2", "optim.lr=0.01")
    assert proc.returncode == 0, proc.stderr
    assert normalise(proc.stdout) == (GOLDEN / "submit_dry_run.sbatch").read_text()
    assert "# task: python -m trainer train --recipe toy --epochs 2 --run-dir /runs/golden --resume auto " \
           "optim.lr=0.01" in proc.stderr
    assert not Path("/jobs/submitit").exists()   # a dry run creates nothing
    assert "# restarts: submitit requeues after a time-out" in proc.stderr      # which retries apply


def test_max_restarts_makes_the_batch_step_supervise_the_training():
    """Issue 48.2: no srun of submitit's; the batch step runs slurm/common.sh's loop (SupervisedTask), which starts
    the training with its own srun. Local clusters and pyxis (srun's flags) are refused."""
    proc = dry_run("--recipe", "toy", "--nodes", "2", "--max-restarts", "2", "--dry-run", "--folder", "/jobs/x")
    assert proc.returncode == 0, proc.stderr
    assert "relaunched inside the allocation up to 2 times" in proc.stderr
    assert "srun" not in proc.stdout and "-m submitit.core._submit /jobs/x/%j" in proc.stdout
    assert "#SBATCH --nodes=2" in proc.stdout
    for other in (("--cluster", "local"), ("--container-image", "nvcr.io/x")):
        bad = dry_run("--recipe", "toy", "--max-restarts", "1", *other, "--dry-run")
        assert bad.returncode == 2 and "the restart loop launches the training with srun" in bad.stderr
    assert "a crashed rank ends the job" in dry_run("--recipe", "toy", "--dry-run").stderr


def test_dry_run_sweep_is_a_job_array_and_pyxis_args():
    proc = dry_run("--recipe", "toy", "--tasks-per-node", "2", "--folder", "/jobs/s", "--run-dir", "/runs/sw",
                   "--sweep", "optim.lr=0.1,0.01,0.001", "--container-image", "nvcr.io#nvidia/pytorch:24.05-py3",
                   "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --array=0-2%3" in proc.stdout
    assert "--container-image 'nvcr.io#nvidia/pytorch:24.05-py3'" in proc.stdout
    assert "python -u -m submitit.core._submit" in proc.stdout
    runs = [line.split("--run-dir ")[1].split()[0] for line in proc.stderr.splitlines() if "# task" in line]
    assert runs == ["/runs/sw/000-optim.lr-0.1", "/runs/sw/001-optim.lr-0.01", "/runs/sw/002-optim.lr-0.001"]


def test_sweep_points_that_look_alike_get_their_own_run_dirs():
    """Seen on main: 'a b' and 'a_b' both became data.path--d-a-b, so two array tasks shared a run dir."""
    proc = dry_run("--recipe", "toy", "--folder", "/jobs/s", "--run-dir", "/runs/sw",
                   "--sweep", "data.path=/d/a b,/d/a_b", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    tasks = [shlex.split(line.split("# task: ")[1]) for line in proc.stderr.splitlines() if "# task" in line]
    runs = [argv[argv.index("--run-dir") + 1] for argv in tasks]
    assert runs == ["/runs/sw/000-data.path--d-a-b", "/runs/sw/001-data.path--d-a-b"]
    assert [argv[-1] for argv in tasks] == ["data.path=/d/a b", "data.path=/d/a_b"]


@pytest.mark.parametrize("sweep", [["optim.lr=0.1,0.1"], ["optim.lr=0.1,0.10"], ["optim.lr=0.1,0.2", "optim.lr=0.1"]])
def test_sweep_points_with_the_same_configuration_are_refused(sweep):
    argv = [a for s in sweep for a in ("--sweep", s)]
    proc = dry_run("--recipe", "toy", "--folder", "/jobs/s", *argv, "--dry-run")
    assert proc.returncode == 2 and "give the same configuration" in proc.stderr, proc.stderr


def test_dry_run_container_wraps_python(tmp_path):
    image = tmp_path / "my image.sif"
    image.write_bytes(b"SIF")
    proc = dry_run("--recipe", "toy", "--folder", "/jobs/c", "--container", str(image), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"apptainer exec --nv {shlex.quote(str(image))} python -u -m submitit.core._submit" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    (["--recipe", "toy", "model.nope=1"], "unknown config key 'model.nope'"),
    (["--recipe", "toy", "--container", "/no/such.sif"], "container image not found: /no/such.sif"),
    (["--recipe", "toy", "--nodes", "2", "--cluster", "local"], "--nodes 2 with --cluster local"),
    (["--recipe", "toy", "--tasks-per-node", "2", "--cluster", "debug"], "use --cluster local"),
    (["--recipe", "toy", "--time", "soon"], "--time 'soon'"),
    (["--recipe", "toy", "--mem", "lots"], "--mem 'lots'"),
    (["--recipe", "toy", "--nodes", "0"], "--nodes 0: must be >= 1"),
    (["--recipe", "toy", "--cpus-per-task", "-2"], "--cpus-per-task -2: must be >= 1"),
    (["--recipe", "toy", "--tasks-per-node", "0"], "--tasks-per-node 0: must be >= 1"),
    (["--recipe", "toy", "--max-num-timeout", "-1"], "--max-num-timeout -1: must be >= 0"),
    (["--recipe", "toy", "--epochs", "-3"], "train.epochs = -3 is out of range"),
    (["--recipe", "toy", "--sweep", "optim.lr=a,b"], "optim.lr"),
    (["--config", "/no/such.yaml"], "/no/such.yaml"),
])
def test_errors_before_submission(argv, message):
    proc = dry_run(*argv, "--folder", "/jobs/e")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not Path("/jobs/e").exists()


def test_unknown_recipe_is_an_argparse_error():
    proc = dry_run("--recipe", "nope", "--dry-run")
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr


@pytest.mark.parametrize("cluster,tasks", [("debug", "1"), ("local", "2")])
def test_debug_and_local_clusters_run_without_slurm(tmp_path, cluster, tasks):
    """As a process: submitit's debug executor runs the task inside it, the local one starts processes."""
    proc = subprocess.run([PY, "hpc/submit.py", "--recipe", "toy", "--cluster", cluster, "--tasks-per-node", tasks,
                           "--epochs", "1", "--folder", str(tmp_path / "sub"), "--run-dir", str(tmp_path / "run"),
                           "--follow"], cwd=REPO, env=clean_env(), text=True, capture_output=True,
                          timeout=limit("run"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    final = proc.stdout.strip().splitlines()[-1]
    assert '"status": "completed"' in final and str(tmp_path / "run") in final
    assert f"world={tasks}" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("minutes,delay", [(60, 120), (4, 120), (3, 120), (2, 60), (1, 1)])
def test_the_time_limit_warning_never_comes_at_the_start(minutes, delay):
    from hpc.submit import signal_delay_s
    assert signal_delay_s(minutes) == delay


HOSTILE = ["evil\n#SBATCH --nodes=64", "evil\nrm -rf ~", "a\rb", "tab\there", "nul\x00x", "esc\x1b[2J"]


def main_in_process(argv, capsys, monkeypatch):
    """hpc/submit.py's main() in this process (fast, and argv may hold a NUL): (exit code, stdout, stderr)."""
    monkeypatch.setenv("TRAINER_PLUGINS", "tests.toy_recipe")
    code = submit.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("flag", ["--job-name", "--account", "--qos", "--constraint", "--partition", "--folder",
                                  "--container-image", "--container-mounts", "--mem", "--time", "--run-dir"])
@pytest.mark.parametrize("value", HOSTILE)
def test_control_characters_are_refused_before_anything_is_written(flag, value, tmp_path, capsys, monkeypatch):
    """Seen on main: a newline in --job-name became a shell line and dropped the #SBATCH lines after it."""
    folder = tmp_path / "jobs"
    argv = ["--recipe", "toy", flag, value] + (["--folder", str(folder)] if flag != "--folder" else [])
    code, out, err = main_in_process([*argv, "--dry-run"], capsys, monkeypatch)
    assert code == 2 and out == "", out
    assert f"error: {flag} {value!r}: control character" in err, err
    assert not folder.exists()
    code, out, err = main_in_process(argv, capsys, monkeypatch)          # a real submission: refused too
    assert code == 2 and "control character" in err and not folder.exists()
    record_fault("newline or other control character in a hpc/submit.py option", steps_lost=0,
                 outcome="refused before anything is written or submitted, naming the flag")


@pytest.mark.parametrize("flag,value", [("--job-name", "my job"), ("--job-name", "a;b"), ("--account", "lab$(id)"),
                                        ("--qos", "normal high"), ("--partition", "gpu;ls"),
                                        ("--constraint", "a100 `id`"), ("--job-name", "")])
def test_slurm_fields_take_only_what_slurm_accepts(flag, value, capsys, monkeypatch):
    code, _, err = main_in_process(["--recipe", "toy", flag, value, "--folder", "/jobs/f", "--dry-run"], capsys,
                                   monkeypatch)
    assert code == 2 and f"error: {flag} {value!r}: Slurm takes" in err, err


def test_ordinary_slurm_field_values_pass():
    """End to end (a subprocess, as a user runs it); sinfo is kept out of reach so the partition is not asked."""
    proc = dry_run("--recipe", "toy", "--job-name", "sasrec_ml-1m.v2", "--account", "lab-01", "--qos", "normal",
                   "--constraint", "a100&ib|[h100*2]", "--partition", "gpu", "--folder", "/jobs/f", "--dry-run",
                   env=clean_env(PATH=str(Path(sys.executable).parent) + ":/bin"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "#SBATCH --job-name=sasrec_ml-1m.v2" in lines and "#SBATCH --constraint='a100&ib|[h100*2]'" in lines
    assert "#SBATCH --requeue" in lines and any(line.startswith("#SBATCH --signal=") for line in lines)


PASS_THROUGH = ("--sbatch", "exclude=node7", "--sbatch", "mail-type=END", "--sbatch", "comment=golden-run",
                "--sbatch", "gres=gpu:a100:4", "--sbatch", "hint=nomultithread", "--sbatch", "overcommit",
                "--srun-arg=--cpu-bind=cores", "--srun-arg=--mpi=none", "--sweep", "optim.lr=0.1,0.01,0.001",
                "--array-parallelism", "2")


def test_dry_run_with_pass_through_options_matches_golden_file():
    """Issue 19.1 (submitit #23, TorchX #389): any sbatch option, extra srun arguments, array parallelism."""
    proc = dry_run("--recipe", "toy", "--nodes", "2", "--folder", "/jobs/pt", "--run-dir", "/runs/pt",
                   "--dry-run", *PASS_THROUGH)
    assert proc.returncode == 0, proc.stderr
    text = normalise(proc.stdout)
    assert text == (GOLDEN / "submit_pass_through.sbatch").read_text()
    assert "#SBATCH --array=0-2%2" in text and "#SBATCH --overcommit" in text
    assert "--kill-on-bad-exit=1 --cpu-bind=cores --mpi=none" in text


@pytest.mark.parametrize("argv,message", [
    (["--sbatch", "nodes=4"], "use --nodes"),
    (["--sbatch", "time=10"], "use --time"),
    (["--sbatch", "output=/tmp/x"], "writes #SBATCH --output itself"),
    (["--sbatch", "comment=two words"], "without spaces"),
    (["--sbatch", "comment=$(id)"], "without spaces, quotes, $"),
    (["--sbatch", "Bad Key=1"], "expected KEY[=VALUE]"),
    (["--sbatch", "comment="], "must be non-empty"),
    (["--sbatch", "comment=a\nb"], "control character"),
    (["--srun-arg", "--x\n#SBATCH --y"], "control character"),
    (["--array-parallelism", "0"], "--array-parallelism 0: must be >= 1"),
])
def test_pass_through_options_are_validated(argv, message):
    proc = dry_run("--recipe", "toy", "--folder", "/jobs/bad", "--dry-run", *argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr

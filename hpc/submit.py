"""Submit trainer runs to Slurm through submitit (or run them locally), one task per GPU.

    trainer-submit --recipe sasrec --config configs/sasrec/ml-1m.yaml --nodes 2 --gpus-per-node 4 \\
        --time 04:00:00 --partition gpu --follow
    python hpc/submit.py --recipe sasrec --nodes 1 --tasks-per-node 4 --dry-run data.path=data/ml-1m
    python hpc/submit.py --recipe sasrec --sweep optim.lr=0.001,0.0003 --sweep model.width=64,128 ...
    python hpc/submit.py --recipe sasrec --search configs/search/sasrec.yaml --trials 12 --array-parallelism 3
    python hpc/submit.py predict --checkpoint runs/sasrec --out top10.parquet --nodes 1 --gpus-per-node 4 --top-k 10

Every trainer flag and key=value override is accepted and validated before anything is submitted.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

try:    # `python hpc/submit.py` works where the project is installed (make setup: pip install -e .)
    from hpc.slurm_info import SubmitError, parse_time_min, partition_gpus, srun_supports
    from trainer.cli.parser import Parser, flag_keys, flags_from_args, get_train_parser, parse_args
    from trainer.config.settings import config_path
    from trainer.native.extras import MissingExtraError, require
except ModuleNotFoundError as err:   # e.g. a Python other than the project's venv
    if err.name not in ("hpc", "trainer"):
        raise
    sys.exit(f"error: {sys.executable} does not have the hpc-trainer package installed ({err}).\n"
             f"HINT: run `make setup` and use .venv/bin/python, or `pip install -e .` in the repository; "
             f"the installed command is `trainer-submit`.")

SIGNAL_DELAY_S = 120    # USR2 this long before the time limit: enough to write a checkpoint
STARTUP_S = 30          # the earliest the warning may come: the trainer and submitit have their handlers


def signal_delay_s(minutes: int) -> int:
    """SIGNAL_DELAY_S, shortened for short jobs so that the warning never comes while the job is starting.
    slurmctld checks time limits every 30 s and signals at the first check at which less than delay + 30 s
    remain, so the warning lands between (limit - delay - 30) and (limit - delay) after the start (measured
    on the local cluster: --time 1 with USR2@30 came 9-30 s after the start, --time 2 with @30 at 62-81 s)."""
    return min(SIGNAL_DELAY_S, max(minutes * 60 - 30 - STARTUP_S, 1))


def get_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="hpc/submit.py", parents=[get_train_parser()],
        description="Submit a trainer run with submitit. Trainer flags and key=value overrides pass through.")
    return add_job_arguments(p)


def add_job_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The job's shape, Slurm options, containers and submission: a training's and a predict's."""
    job = p.add_argument_group("job shape and Slurm options")
    job.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    job.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                     help="GPUs per node; one task (rank) per GPU")
    job.add_argument("--tasks-per-node", type=int, metavar="T", help="tasks per node for CPU-only jobs (default 1)")
    job.add_argument("--cpus-per-task", type=int, metavar="C", help="CPUs per task (also sets the torch threads)")
    job.add_argument("--mem", metavar="M", help="memory per node, e.g. 64G")
    job.add_argument("--time", default="01:00:00", metavar="HH:MM:SS", help="time limit (default 01:00:00)")
    job.add_argument("--partition", metavar="P")
    job.add_argument("--account", metavar="A")
    job.add_argument("--qos", metavar="Q")
    job.add_argument("--job-name", metavar="J", help="default trainer-<recipe>")
    job.add_argument("--constraint", metavar="FEATURES")
    job.add_argument("--exclusive", action="store_true", help="whole nodes")
    job.add_argument("--max-num-timeout", type=int, default=3, metavar="N",
                     help="requeue after a time-out at most N times (preemptions do not count; default 3)")
    job.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="relaunch a crashed training step inside the allocation up to N times (default 0: "
                          "submitit's own model, one srun step that fails with its first crashed rank). N > 0: the "
                          "batch step itself (no srun of submitit's) runs slurm/common.sh's restart loop, as "
                          "MAX_RESTARTS=N does for the sbatch scripts; --cluster slurm only, not with "
                          "--container-image")
    job.add_argument("--sbatch", action="append", default=[], metavar="KEY[=VALUE]",
                     help="any other sbatch option, into the batch script as #SBATCH --KEY=VALUE (repeatable), "
                          "e.g. --sbatch gres=gpu:a100:4 --sbatch exclude=node7 --sbatch mail-type=END")
    job.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                     help="an extra argument of the srun line that starts the tasks (repeatable; write "
                          "--srun-arg=--cpu-bind=cores for values that start with -)")
    job.add_argument("--array-parallelism", type=int, metavar="N",
                     help="--sweep: at most N array tasks run at once (#SBATCH --array=0-K%%N)")
    box = p.add_argument_group("containers")
    box.add_argument("--container", metavar="IMAGE.sif", help="run every task in `apptainer exec --nv IMAGE.sif`")
    box.add_argument("--container-image", metavar="REF", help="pyxis/enroot image (srun --container-image)")
    box.add_argument("--container-mounts", metavar="SRC:DST,...",
                     help="pyxis mounts (default: the current directory)")
    sub = p.add_argument_group("submission")
    sub.add_argument("--cluster", choices=["slurm", "local", "debug"], default="slurm",
                     help="slurm (default); local: same tasks as local processes; debug: in this process")
    sub.add_argument("--sweep", action="append", default=[], metavar="key=v1,v2",
                     help="job array over the product of all --sweep values, one run directory each")
    sub.add_argument("--sweep-points", metavar="I,J,...",
                     help="--sweep: submit only these points (their indices, as `python -m trainer runs DIR "
                          "--rerun-failed` prints them), into the same --run-dir: each resumes from its checkpoint")
    sub.add_argument("--search", metavar="SPACE.yaml",
                     help="an Optuna search instead of a grid: a job array of --trials tasks, each training the "
                          "next trial of the study in --run-dir (journal storage there; trainer/search/space.py "
                          "describes the file)")
    sub.add_argument("--trials", type=int, metavar="N", help="--search: how many trials (array tasks)")
    sub.add_argument("--folder", default="runs/submitit", help="submitit folder (created private, 0700)")
    sub.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    sub.add_argument("--follow", action="store_true", help="stream rank 0's log; exit with the job's state")
    return p


# ----------------------------------------------------------------------------------------------- validation

def tasks_per_node(args) -> int:
    """One task per GPU; CPU-only jobs take --tasks-per-node."""
    if args.gpus_per_node and args.tasks_per_node and args.tasks_per_node != args.gpus_per_node:
        raise SubmitError(f"--tasks-per-node {args.tasks_per_node} with --gpus-per-node {args.gpus_per_node}: "
                          "GPU jobs run one task per GPU (drop --tasks-per-node)")
    return args.gpus_per_node or args.tasks_per_node or 1


def parse_sweeps(items: list[str]) -> list[list[str]]:
    """['a=1,2', 'b=x,y'] -> [['a=1','b=x'], ['a=1','b=y'], ...] (product, in order)."""
    axes = []
    for item in items:
        key, sep, values = item.partition("=")
        options = [v for v in values.split(",") if v != ""]
        if not sep or not key or not options:
            raise SubmitError(f"--sweep {item!r}: expected key=v1,v2,...")
        axes.append([f"{key}={v}" for v in options])
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def combo_name(index: int, overrides: list[str]) -> str:
    """A directory name for sweep point `index`: (0, ['optim.lr=0.01']) -> '000-optim.lr-0.01'. The index
    keeps it unique; the slug (lossy: 'a b' and 'a_b' look alike) is only there to be read."""
    slug = "_".join(re.sub(r"[^A-Za-z0-9.+-]", "-", o.replace("=", "-")) for o in overrides)
    return f"{index:03d}-{slug[:80]}" if slug else f"{index:03d}"


def check_config(args, extra: list[str]):
    """Build the config exactly as each task will (unknown recipe/keys, bad values fail here)."""
    from trainer.config.settings import build_config
    return build_config(args.recipe, args.config, flags_from_args(args), list(args.overrides) + extra)


CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NAME = r"[A-Za-z0-9_.+-]+"
# what Slurm accepts in each field that submitit writes into an `#SBATCH --key=value` line (unquoted)
SLURM_FIELDS = {
    "job_name": (r"[A-Za-z0-9_.+@%:=-]{1,200}", "letters, digits and _ . + @ % : = -"),
    "partition": (f"{NAME}(,{NAME})*", "partition names, comma separated"),
    "account": (NAME, "letters, digits and _ . + -"),
    "qos": (f"{NAME}(,{NAME})*", "QOS names, comma separated"),
    "constraint": (r"[A-Za-z0-9_.+\-&|,*\[\]():!]+", "feature names with & | , * [ ] ( ) : !"),
}


def check_text_fields(args) -> None:
    """No control characters in any option (a newline in a field becomes a line of the batch script), and
    the fields written into #SBATCH lines hold only what Slurm accepts there."""
    for dest, value in sorted(vars(args).items()):
        values = value if isinstance(value, list) else [value]
        for item in values:
            bad = CONTROL.search(item) if isinstance(item, str) else None
            if bad:
                flag = "--" + dest.replace("_", "-") if dest != "overrides" else "key=value override"
                raise SubmitError(f"{flag} {item!r}: control character {bad.group()!r} not allowed "
                                  f"(it would end a line of the batch script)")
    for dest, (pattern, allowed) in SLURM_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None and not re.fullmatch(pattern, value):
            raise SubmitError(f"--{dest.replace('_', '-')} {value!r}: Slurm takes {allowed} here")


# sbatch options this tool writes itself, and the flag to use instead of --sbatch KEY=...
OWNED = {"nodes": "--nodes", "ntasks-per-node": "--gpus-per-node / --tasks-per-node", "gpus-per-node":
         "--gpus-per-node", "cpus-per-task": "--cpus-per-task", "time": "--time", "job-name": "--job-name",
         "partition": "--partition", "account": "--account", "qos": "--qos", "constraint": "--constraint",
         "exclusive": "--exclusive", "mem": "--mem", "array": "--sweep / --search --trials / --array-parallelism",
         "output": "(submitit's, in --folder)", "error": "(submitit's, in --folder)", "open-mode": "(submitit's)",
         "signal": "(USR2 before the time limit: the checkpoint)", "requeue": "(always on)",
         "wckey": None}


def sbatch_options(items: list[str]) -> dict[str, Any]:
    """--sbatch KEY[=VALUE] -> submitit's additional_parameters {key_with_underscores: value or True}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
            raise SubmitError(f"--sbatch {item!r}: expected KEY[=VALUE] with an sbatch long option as KEY "
                              f"(e.g. --sbatch exclude=node7)")
        if key in OWNED and OWNED[key]:
            raise SubmitError(f"--sbatch {item!r}: this script writes #SBATCH --{key} itself; use {OWNED[key]}")
        if sep and (not value or re.search(r"[\s'\"`$\\]", value)):
            raise SubmitError(f"--sbatch {item!r}: the value must be non-empty without spaces, quotes, $, ` or \\ "
                              f"(it is written unquoted into an #SBATCH line)")
        out[key.replace("-", "_")] = value if sep else True
    return out


def restarts_note(args) -> str:
    """Which retries a job gets (for --dry-run)."""
    requeue = f"submitit requeues after a time-out (at most --max-num-timeout={args.max_num_timeout}) or a preemption"
    if args.max_restarts:
        return (f"{requeue}; a crashed training step is relaunched inside the allocation up to "
                f"{args.max_restarts} times (the batch step runs slurm/common.sh's loop; no srun of submitit's)")
    return f"{requeue}; a crashed rank ends the job (--max-restarts N relaunches inside the allocation)"


def validate(args) -> None:
    """Everything that can be checked before submitting; raises SubmitError with a hint."""
    check_text_fields(args)
    sbatch_options(args.sbatch)
    if args.array_parallelism is not None and args.array_parallelism < 1:
        raise SubmitError(f"--array-parallelism {args.array_parallelism}: must be >= 1")
    for flag, value, low in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 0),
                             ("--tasks-per-node", args.tasks_per_node, 1), ("--cpus-per-task", args.cpus_per_task, 1),
                             ("--max-num-timeout", args.max_num_timeout, 0)):
        if value is not None and value < low:
            raise SubmitError(f"{flag} {value}: must be >= {low}")
    tasks_per_node(args)
    if args.max_restarts < 0:
        raise SubmitError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.max_restarts and (args.cluster != "slurm" or args.container_image):
        what = f"--cluster {args.cluster}" if args.cluster != "slurm" else "--container-image (pyxis: srun's flags)"
        raise SubmitError(f"--max-restarts {args.max_restarts} with {what}: the restart loop launches the training "
                          f"with srun inside a Slurm allocation.\nHINT: --cluster slurm, and --container IMAGE.sif "
                          f"for a container")
    if args.cluster in ("local", "debug") and args.nodes > 1:
        raise SubmitError(f"--nodes {args.nodes} with --cluster {args.cluster}: local runs use this one machine "
                          "(use --cluster slurm, or --tasks-per-node for several local ranks)")
    if args.cluster == "debug" and tasks_per_node(args) > 1:
        raise SubmitError("--cluster debug runs one task in this process: use --cluster local for several ranks")
    if args.container and args.container_image:
        raise SubmitError("--container (apptainer) and --container-image (pyxis) exclude each other")
    if args.container and not Path(args.container).is_file():
        raise SubmitError(f"container image not found: {args.container} (build it with `make sif`)")
    if args.mem and not re.fullmatch(r"\d+[KMGT]?", args.mem):
        raise SubmitError(f"--mem {args.mem!r}: expected a number with an optional K/M/G/T suffix")
    parse_time_min(args.time)
    found = partition_gpus(args.partition) if args.cluster == "slurm" else None
    if found is not None and args.gpus_per_node > found[1]:
        raise SubmitError(f"--gpus-per-node {args.gpus_per_node}: nodes of partition {found[0]!r} have at "
                          f"most {found[1]} GPUs (ask `sinfo -N -o '%P %G'`)")
    if getattr(args, "predict", False):
        return
    if args.search or args.trials is not None:
        check_search(args)
    from trainer.config.data_source import check_generated_data
    from trainer.config.settings import to_dict
    seen: dict[str, list[str]] = {}
    args.data_notes = []
    for extra in parse_sweeps(args.sweep) if not args.search else search_checks(args):
        cfg = check_config(args, extra)
        args.recipe = cfg.recipe  # the recipe may come from the YAML file
        # the tasks run under submitit on a cluster; --cluster local/debug are this machine's processes
        args.data_notes.append(check_generated_data(cfg.data, "submitit" if args.cluster == "slurm" else "local"))
        key = json.dumps(to_dict(cfg), sort_keys=True, default=str)
        if key in seen and not args.search:
            raise SubmitError(f"--sweep: the points {' '.join(seen[key])} and {' '.join(extra)} give the same "
                              f"configuration: each run would resume from and overwrite the other's "
                              f"checkpoints (drop the repeated value)")
        seen[key] = extra


def check_search(args) -> None:
    """--search and --trials: together, not with a grid; the space file read (errors name its line and field)."""
    from trainer.search.space import load_space
    if not args.search or args.trials is None:
        raise SubmitError("--search SPACE.yaml and --trials N go together (a search of N trials)")
    if args.trials < 1:
        raise SubmitError(f"--trials {args.trials}: must be >= 1")
    if args.sweep or getattr(args, "sweep_points", None):
        raise SubmitError("--search and --sweep exclude each other: a search draws its points, a grid lists them")
    args.space = load_space(args.search)
    if args.space.metric:       # every trial selects its best epoch by the metric the study optimises
        args.overrides = [*args.overrides, f"train.select_metric={args.space.metric}"]


def search_checks(args) -> list[list[str]]:
    """The configs a search's check builds: its lowest values, its highest, and every choice (a bad key or a value
    out of a key's bounds fails here, naming the key, before anything is submitted)."""
    params = args.space.params
    ends = [[f"{k}={p.bounds()[end]}" for k, p in params.items() if p.kind != "choices"] for end in (0, -1)]
    choices = [[f"{k}={c}"] for k, p in params.items() if p.kind == "choices" for c in p.choices]
    return [point for point in (*ends, *choices) if point] or [[]]


def search_metric(args) -> tuple[str, str]:
    """(metric, mode) the search optimises: the space's, else train.select_metric's, else the recipe's."""
    from trainer.config.registry import get_spec
    from trainer.engine.selection import selected_metric
    cfg = check_config(args, [])
    if ":" in cfg.train.select_metric:          # NAME:max|min: no need of the recipe's class (and torch)
        return selected_metric(cfg.train.select_metric, ("", "max"))
    return selected_metric(cfg.train.select_metric, tuple(get_spec(cfg.recipe).recipe_class().primary_metric))


def search_dir(args) -> Path:
    return Path(args.run_dir or f"runs/{args.recipe or 'run'}-search-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


# ------------------------------------------------------------------------------------------ job description

def trainer_argv(args, run_dir: Path | None, extra: list[str]) -> list[str]:
    """The `python -m trainer train` arguments of one run (absolute paths: tasks may start elsewhere); run_dir None:
    without --run-dir and --resume (a search's task adds its trial's)."""
    argv = []
    for dest in ("recipe", "config", *flag_keys()):
        value = getattr(args, dest, None)
        if value is None or dest in ("run_dir", "resume"):
            continue
        if dest == "config":
            value = str(config_path(value).resolve())      # as the trainer finds it: here, else the repository's
        if dest == "gpu_ids":
            value = ",".join(map(str, value))
        argv += [f"--{dest.replace('_', '-')}"] if value is True else [f"--{dest.replace('_', '-')}", str(value)]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir), "--resume", args.resume or "auto"]
    return argv + list(args.overrides) + extra


def run_dirs(args, sweeps: list[list[str]]) -> list[Path]:
    """--run-dir (default runs/<recipe>-<time>), with one sub-folder per sweep point."""
    base = Path(args.run_dir or f"runs/{args.recipe or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return [base] if sweeps == [[]] else [base / combo_name(i, extra) for i, extra in enumerate(sweeps)]


def sweep_points(args, sweeps: list[list[str]]) -> list[int]:
    """The indices of the sweep points to submit: --sweep-points, else every one."""
    given = getattr(args, "sweep_points", None)
    if not given:
        return list(range(len(sweeps)))
    if sweeps == [[]]:
        raise SubmitError("--sweep-points needs --sweep (the points of which grid?)")
    if not args.run_dir:
        raise SubmitError("--sweep-points: give the sweep's --run-dir, so that each point resumes in its own folder")
    try:
        points = sorted({int(x) for x in given.split(",") if x.strip()})
    except ValueError:
        raise SubmitError(f"--sweep-points {given!r}: expected indices such as 1,4") from None
    outside = [i for i in points if not 0 <= i < len(sweeps)]
    if outside or not points:
        raise SubmitError(f"--sweep-points {given!r}: the grid has points 0..{len(sweeps) - 1}")
    return points


def container_python(args) -> str | None:
    """The shell words that start python inside the task (None: this interpreter). Under --max-restarts the
    supervising batch step runs this interpreter, and slurm/common.sh starts the tasks in the image (IMAGE)."""
    if args.container and not args.max_restarts:
        return shlex.join(["apptainer", "exec", "--nv", str(Path(args.container).resolve()), "python"])
    if args.container_image:
        return "python"
    return None


def slurm_parameters(args, folder: Path) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (sbatch names)."""
    params: dict[str, Any] = dict(
        job_name=args.job_name or f"trainer-{args.recipe}", nodes=args.nodes, ntasks_per_node=tasks_per_node(args),
        time=parse_time_min(args.time), signal_delay_s=signal_delay_s(parse_time_min(args.time)),
        additional_parameters={"requeue": True})
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    for name in ("cpus_per_task", "partition", "account", "qos", "constraint"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.exclusive:
        params["exclusive"] = True
    if args.mem:
        params["additional_parameters"]["mem"] = args.mem
    params["additional_parameters"].update(sbatch_options(args.sbatch))
    if args.array_parallelism:
        params["array_parallelism"] = args.array_parallelism
    if args.cpus_per_task:
        # Slurm >= 22.05: srun no longer inherits --cpus-per-task from the allocation
        params["setup"] = ["export SRUN_CPUS_PER_TASK=\"$SLURM_CPUS_PER_TASK\""]
    # a rank that dies (an exception, a failed save) ends the step at once instead of leaving the others
    # in a collective or the rendezvous until dist.timeout_s
    params["srun_args"] = ["--kill-on-bad-exit=1", *args.srun_arg]
    if args.max_restarts:       # the batch step supervises: slurm/common.sh's loop runs the training's srun
        params.update(use_srun=False)
        params.pop("srun_args")
    if args.container_image:
        mounts = args.container_mounts or f"{Path.cwd()}:{Path.cwd()}"
        if str(folder) not in mounts and not str(folder).startswith(str(Path.cwd())):
            mounts += f",{folder}:{folder}"
        params["srun_args"] += ["--container-image", args.container_image, "--container-mounts", mounts,
                                "--container-workdir", str(Path.cwd())]
    return params


def private_folder(path: str) -> Path:
    """The submitit folder, created (or tightened) to 0700: it holds pickles and logs of the user's jobs."""
    folder = Path(path).resolve()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_mode & 0o077:
        folder.chmod(0o700)
    return folder


def job_folder(folder: Path) -> Path:
    return folder / "%j"


def render_sbatch(args, folder: Path, n_jobs: int) -> str:
    """Exactly the script submitit's SlurmExecutor writes for these arguments."""
    require("submitit", extra="submit", purpose="hpc/submit.py (rendering and submitting jobs)")
    from submitit.slurm.slurm import _make_sbatch_string
    jf = job_folder(folder)
    command = " ".join([container_python(args) or shlex.quote(sys.executable), "-u -m submitit.core._submit",
                        shlex.quote(str(jf))])
    params = slurm_parameters(args, folder)
    return _make_sbatch_string(command=command, folder=jf, map_count=n_jobs if n_jobs > 1 else None, **params)


def make_executor(args, folder: Path):
    """submitit executor for --cluster."""
    submitit = require("submitit", extra="submit", purpose="hpc/submit.py (submitting jobs)")
    jf = job_folder(folder)
    if args.cluster == "debug":
        return submitit.DebugExecutor(jf)
    if args.cluster == "local":
        ex = submitit.LocalExecutor(jf, max_num_timeout=args.max_num_timeout, python=container_python(args))
        ex.update_parameters(timeout_min=parse_time_min(args.time), tasks_per_node=tasks_per_node(args),
                             gpus_per_node=args.gpus_per_node or 0,
                             signal_delay_s=signal_delay_s(parse_time_min(args.time)))
        return ex
    ex = submitit.SlurmExecutor(jf, max_num_timeout=args.max_num_timeout, python=container_python(args))
    ex.update_parameters(**slurm_parameters(args, folder))
    return ex


def submit(args) -> tuple[list, list[Path]]:
    """Validate, then submit one job (or a job array for --sweep). Returns (jobs, run directories)."""
    from hpc.task import SupervisedTask, TrainTask
    validate(args)
    if args.cluster == "slurm" and args.container_image and not srun_supports("--container-image"):
        raise SubmitError("srun has no --container-image: pyxis is not installed on this cluster "
                          "(use --container IMAGE.sif with apptainer instead)")
    if args.search:
        return submit_search(args)
    sweeps = parse_sweeps(args.sweep)
    points = sweep_points(args, sweeps)
    dirs = [run_dirs(args, sweeps)[i] for i in points]
    sweeps = [sweeps[i] for i in points]
    if args.max_restarts:
        image = str(Path(args.container).resolve()) if args.container else None
        tasks = [SupervisedTask(trainer_argv(args, d, extra), args.max_restarts, image)
                 for d, extra in zip(dirs, sweeps)]
    else:
        tasks = [TrainTask(trainer_argv(args, d, extra)) for d, extra in zip(dirs, sweeps)]
    executor = make_executor(args, private_folder(args.folder))
    if len(tasks) == 1:
        return [executor.submit(tasks[0])], dirs
    with executor.batch():
        jobs = [executor.submit(task) for task in tasks]
    return jobs, dirs


def submit_search(args) -> tuple[list, list[Path]]:
    """The study created (or continued) in the search folder, then a job array of --trials SearchTasks."""
    from hpc.task import SearchTask
    from trainer.search.study import create_study
    folder = search_dir(args)
    metric, mode = search_metric(args)
    slots = create_study(folder, args.space, metric, mode, args.trials)
    image = str(Path(args.container).resolve()) if args.container and args.max_restarts else None
    tasks = [SearchTask(trainer_argv(args, None, []), str(folder), slot, args.max_restarts, image) for slot in slots]
    executor = make_executor(args, private_folder(args.folder))
    if len(tasks) == 1:
        return [executor.submit(tasks[0])], [folder]
    with executor.batch():
        jobs = [executor.submit(task) for task in tasks]
    return jobs, [folder] * len(jobs)


# ------------------------------------------------------------------------------------------------ following

class Tail:
    """Prints what was appended to a file since the last call (restarts if the file shrinks)."""

    def __init__(self, path: Path):
        self.path, self.offset = Path(path), 0

    def poll(self, out) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        self.offset = 0 if size < self.offset else self.offset
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        if data:
            out.write(data.decode(errors="replace"))
            out.flush()


def follow(jobs, poll_s: float = 1.0, out=sys.stdout) -> int:
    """Stream the first job's rank-0 output until every job is done; 0 if all completed."""
    tails = [Tail(jobs[0].paths.stdout), Tail(jobs[0].paths.stderr)]
    while not all(job.done() for job in jobs):
        for tail in tails:
            tail.poll(out)
        time.sleep(poll_s)
    for tail in tails:
        tail.poll(out)
    failed = 0
    for job in jobs:
        try:
            result, error = job.results()[0], None   # rank 0's summary
        except Exception as err:  # submitit's UncompletedJobError / FailedJobError
            result, error = None, exception_line(str(err))
        state = final_state(job)
        ok = error is None and state in ("COMPLETED", "DONE", "FINISHED")
        failed += not ok
        detail = json.dumps(result, default=str) if error is None else f"failed: {error}"
        print(f"job {job.job_id}: {state} {detail}", file=out, flush=True)
    return 1 if failed else 0


def exception_line(text: str) -> str:
    """The 'SomeError: message' line of a submitit failure report (else its first line)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    found = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Interrupt): ", line)]
    return (found or lines or [""])[-1 if found else 0]


def final_state(job, wait_s: float = 30.0) -> str:
    """The job's accounting state once terminal (a result file can appear before sacct says so)."""
    from submitit.slurm.slurm import SlurmJob
    if not isinstance(job, SlurmJob):
        return job.state
    deadline = time.monotonic() + wait_s
    state = job.watcher.get_state(job.job_id, mode="force")
    while state in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED", "UNKNOWN") and time.monotonic() < deadline:
        time.sleep(1.0)
        state = job.watcher.get_state(job.job_id, mode="force")
    return state


def describe(jobs, dirs: list[Path]) -> str:
    lines = [f"submitted job {job.job_id}  run dir {d}" for job, d in zip(jobs, dirs)]
    lines.append(f"rank 0 log: tail -f {shlex.quote(str(jobs[0].paths.stderr))}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- predict

def get_predict_parser() -> argparse.ArgumentParser:
    from trainer.cli.parser import add_predict_arguments
    p = Parser(prog="hpc/submit.py predict",
               description="Submit `trainer predict` with submitit: every task writes its parts of --out, rank 0 "
                           "joins them; the time-limit warning requeues the job, which continues from its parts.")
    return add_job_arguments(add_predict_arguments(p))


def predict_argv(args) -> list[str]:
    """The `python -m trainer predict` arguments (absolute paths: tasks may start elsewhere)."""
    argv = ["--checkpoint", str(Path(args.checkpoint).resolve()), "--out", str(Path(args.out).resolve()),
            "--top-k", str(args.top_k), "--history", args.history, "--unknown-users", args.unknown_users,
            "--part-size", str(args.part_size)]
    for flag in ("data", "users"):
        if getattr(args, flag):
            argv += [f"--{flag}", str(Path(getattr(args, flag)).resolve())]
    argv += [f"--{flag.replace('_', '-')}" for flag in ("keep_seen", "parts", "overwrite") if getattr(args, flag)]
    return argv + list(args.overrides)


def main_predict(argv: list[str]) -> int:
    from hpc.task import PredictTask
    from trainer.engine.predict import request_of
    from trainer.engine.predict_parts import check_out
    args = parse_args(get_predict_parser(), argv, legacy_flags=False)
    args.predict, args.recipe = True, "predict"
    try:
        if args.sweep or args.max_restarts:
            raise SubmitError("--sweep and --max-restarts are for training: a predict is one job, requeued "
                              "whole (it continues from the parts it wrote)")
        if not Path(args.checkpoint).exists():
            raise SubmitError(f"--checkpoint {args.checkpoint}: no such run directory or file")
        request_of(args)
        check_out(Path(args.out), args.overwrite)
        validate(args)
        task = PredictTask(predict_argv(args))
        if args.dry_run:
            print("# task: python -m trainer predict " + shlex.join(task.argv), file=sys.stderr)
            if args.cluster == "slurm":
                print(render_sbatch(args, Path(args.folder).resolve(), 1), end="")
            return 0
        job = make_executor(args, private_folder(args.folder)).submit(task)
    except (ValueError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"submitted job {job.job_id}  predictions to {Path(args.out).resolve()}\n"
          f"rank 0 log: tail -f {shlex.quote(str(job.paths.stderr))}", flush=True)
    if args.follow or args.cluster == "debug":
        return follow([job])
    return 0


def print_dry_run(args) -> int:
    """--dry-run: each task's command and data on stderr, the sbatch script on stdout; nothing submitted."""
    validate(args)
    if args.search:
        return print_search_dry_run(args)
    sweeps = parse_sweeps(args.sweep)
    points = sweep_points(args, sweeps)
    dirs, notes = run_dirs(args, sweeps), list(args.data_notes)
    for i in points:
        print("# task: python -m trainer train " + shlex.join(trainer_argv(args, dirs[i], sweeps[i])), file=sys.stderr)
        print(f"# data: {notes[i] or 'as the recipe reads it'}", file=sys.stderr)
    print(f"# restarts: {restarts_note(args)}", file=sys.stderr)
    if args.cluster != "slurm":
        print(f"# --cluster {args.cluster}: no sbatch script; tasks run as local processes", file=sys.stderr)
        return 0
    print(render_sbatch(args, Path(args.folder).resolve(), len(points)), end="")
    return 0


def print_search_dry_run(args) -> int:
    """--dry-run of a search: the space, the tasks' command and the array's sbatch script; no study created."""
    metric, mode = search_metric(args)
    space = args.space
    print(f"# search: {args.trials} trials of {', '.join(space.params)} in {search_dir(args)}, optimising "
          f"{metric}:{mode} ({space.sampler} sampler, pruner {space.pruner})", file=sys.stderr)
    print("# task: python -m trainer train " + shlex.join(trainer_argv(args, None, [])) +
          " --run-dir DIR/NNN-trialT --resume auto KEY=VALUE... search.study=DIR search.trial=T", file=sys.stderr)
    print(f"# data: {args.data_notes[0] or 'as the recipe reads it'}", file=sys.stderr)
    print(f"# restarts: {restarts_note(args)}; a requeued task continues its own trial", file=sys.stderr)
    if args.cluster != "slurm":
        print(f"# --cluster {args.cluster}: no sbatch script; tasks run as local processes", file=sys.stderr)
        return 0
    print(render_sbatch(args, Path(args.folder).resolve(), args.trials), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:
        return main_predict(argv[1:])
    parser = get_parser()
    args = parse_args(parser, argv, legacy_flags=True)
    try:
        if args.dry_run:
            return print_dry_run(args)
        jobs, dirs = submit(args)
    except (ValueError, MissingExtraError) as err:  # SubmitError, ConfigError from check_config, no submitit
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:                        # submitit's FailedJobError (submitit may be missing)
        if type(err).__name__ != "FailedJobError":
            raise
        print(f"error: sbatch refused the job: {str(err).strip() or err.__cause__}", file=sys.stderr)
        return 1
    print(describe(jobs, dirs), flush=True)
    if args.search:
        table = shlex.join(["python", "-m", "trainer", "runs", str(dirs[0])])
        print(f"search: {len(jobs)} trials into {dirs[0]}; the table: {table}", flush=True)
    for note in dict.fromkeys(n for n in getattr(args, "data_notes", []) if n and n.startswith("generated")):
        print(f"data: {note}: the tasks train on the recipe's generated data", flush=True)
    if args.follow or args.cluster == "debug":
        return follow(jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

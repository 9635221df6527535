"""The callables that submitit pickles and runs in every task: one trainer run, requeueable (or a predict).

    from hpc.task import TrainTask
    TrainTask(["--recipe", "sasrec", "--run-dir", "/abs/runs/x", "data.path=..."])()   # one process
    PredictTask(["--checkpoint", "/abs/runs/x", "--out", "/abs/top10.csv"])()

Preemption: the engine installs flag-only handlers for USR1/USR2/TERM, ckpt.requeue_signals and submitit's
preemption signal (SUBMITIT_PREEMPT_SIGNAL, default USR2), so a signal is turned into an
agreed checkpoint on every rank. Afterwards rank 0 hands the requeue signal to submitit's own handler
(still installed underneath), which calls checkpoint() below, counts time-outs against max_num_timeout
and runs `scontrol requeue`. After SIGTERM (scancel, partition preemption) nothing is requeued here:
Slurm requeues preempted jobs itself, and a cancelled job must stay cancelled. The tasks then wait to
be killed, as submitit's own SIGTERM handler does: a job that ends by itself during the preemption
GraceTime is recorded FAILED and is not requeued (Slurm 22.05).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

log = logging.getLogger(__name__)
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _bind_threads() -> None:
    """One OpenMP pool per task sized by --cpus-per-task (Slurm no longer exports OMP_NUM_THREADS)."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if cpus.isdigit() and "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(int(cpus))


class TrainTask:
    """Runs `python -m trainer train ARGV` in-process; checkpoint() resumes from the run directory."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __repr__(self) -> str:
        return f"TrainTask({self.argv!r})"

    def __call__(self) -> dict[str, Any]:
        from trainer.cli.parser import flags_from_args, get_parser, parse_args
        from trainer.config.settings import configure
        from trainer.distributed.environment import select_environment
        from trainer.engine.session import run_train
        _bind_threads()
        logging.getLogger("submitit").propagate = False   # it has its own handler: no doubled lines
        args = parse_args(get_parser(), ["train", *self.argv])
        result, cfg = run_train(*configure(args.recipe, args.config, flags_from_args(args), args.overrides))
        where = select_environment()          # the launch facts, as the trainer read them
        summary = dict(status=result.status, global_step=result.global_step, metrics=result.metrics,
                       run_dir=os.path.abspath(cfg.run_dir), restarts=where.restart_count)
        if result.status == "preempted":
            self._after_preemption(result, where.rank, signal.Signals[where.preempt_signal or "SIGUSR2"])
        return summary

    def _after_preemption(self, result, rank: int, preempt: signal.Signals) -> None:
        """Every rank has saved the same checkpoint; now requeue (rank 0) or leave without a result."""
        from trainer.engine.exits import exit_code_of
        if os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
            return  # in-process (debug): report the preempted status to the caller
        signum = result.signal
        requeue = signum in (*REQUEUE_SIGNALS, preempt)
        handler = signal.getsignal(preempt)
        if requeue and rank == 0 and callable(handler):
            handler(preempt, None)  # submitit: checkpoint(), then requeue or raise
        if not requeue:
            time.sleep(float(os.environ.get("TERM_HOLD_S", 600)))
        # no result pickle for a job that goes on later (SystemExit is not caught by submitit)
        sys.exit(0 if requeue else exit_code_of(result))     # trainer/engine/exits.py: 128 + the signal

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit on rank 0 before requeueing: the same run, resumed from its newest checkpoint."""
        import submitit
        argv = list(self.argv)
        if "--resume" in argv:
            i = argv.index("--resume")
            del argv[i:i + 2]
        return submitit.helpers.DelayedSubmission(TrainTask(argv + ["--resume", "auto"]), *args, **kwargs)


class SupervisedTask:
    """hpc/submit.py --max-restarts N: submitit runs this once, in the batch step (no srun of its own), and it runs
    slurm/common.sh's restart loop there: the training is an inner srun over the whole allocation, relaunched
    after a retryable failure from the agreed checkpoint, exactly as the sbatch scripts do. The inner tasks see a
    plain Slurm step (submitit's variables are not passed on), so a time-limit signal makes rank 0 requeue the job,
    and the requeued job runs this again with --resume auto."""

    def __init__(self, argv: list[str], max_restarts: int, image: str | None = None):
        self.argv, self.max_restarts, self.image = list(argv), max_restarts, image

    def __repr__(self) -> str:
        return f"SupervisedTask({self.argv!r}, max_restarts={self.max_restarts})"

    def __call__(self) -> dict[str, Any]:
        import subprocess
        from pathlib import Path
        home = Path(__file__).resolve().parents[1]
        run_dir = self.argv[self.argv.index("--run-dir") + 1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUBMITIT_")}
        env.update(TRAINER_HOME=str(home), RUN_DIR=run_dir, MAX_RESTARTS=str(self.max_restarts))
        if self.image:          # the tasks run in the image (common.sh's apptainer wrapper); this step on the host
            env.update(IMAGE=self.image)
        else:
            env.update(PYTHON=sys.executable)
        loop = ('set -euo pipefail; source "$TRAINER_HOME/slurm/common.sh"; '
                'run_training srun --kill-on-bad-exit=1 "${LAUNCH[@]}" -m trainer train "$@"')
        code = subprocess.run(["bash", "-c", loop, "supervised-training", *self.argv], env=env).returncode
        from trainer.launch.exitcodes import PRUNED
        from trainer.launch.restarts import read_jsonl
        relaunches = sum(r.get("decision") == "relaunch" for r in read_jsonl(Path(run_dir) / "restarts.jsonl"))
        if code == PRUNED:          # a search trial its study's pruner ended: not a failure of the job
            return dict(status="pruned", run_dir=run_dir, relaunches=relaunches)
        if code != 0:
            raise RuntimeError(f"the training step failed (exit {code}) after {relaunches} relaunch(es) in this "
                               f"job; see {run_dir}/restarts.jsonl or `python -m trainer doctor --run {run_dir}`")
        return dict(status="completed", run_dir=run_dir, relaunches=relaunches)


class PredictTask:
    """hpc/submit.py predict: `python -m trainer predict ARGV` in every task. Each rank writes its parts; a
    time-limit signal stops each after its current part and rank 0 requeues the job (`scontrol requeue`), which
    runs this again: it continues from the parts written. Stopped, a task leaves no result (no pickle for a job that
    goes on later)."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __repr__(self) -> str:
        return f"PredictTask({self.argv!r})"

    def __call__(self) -> dict[str, Any]:
        from trainer.cli.parser import get_parser, parse_args
        from trainer.engine.predict import run_predict
        _bind_threads()
        logging.getLogger("submitit").propagate = False
        outcome = run_predict(parse_args(get_parser(), ["predict", *self.argv]))
        if outcome.status == "stopped" and os.environ.get("SUBMITIT_EXECUTOR") in ("slurm", "local"):
            sys.exit(outcome.code)
        return dict(status=outcome.status, out=outcome.out)


class SearchTask:
    """hpc/submit.py --search: array task `slot` of a search. It claims its trial from the study in `search_dir`
    (rank 0 or the batch step asks, the other ranks wait for the claim; a requeued, restarted or resumed task finds
    its claim and continues the same trial in the same run directory), trains it as TrainTask (or SupervisedTask,
    with --max-restarts) does, then tells the study how the trial ended (completed with its best value, pruned, or
    failed: the study goes on). A preempted trial tells nothing: its task comes back and continues it."""

    def __init__(self, argv: list[str], search_dir: str, slot: int, max_restarts: int = 0, image: str | None = None):
        self.argv, self.search_dir, self.slot = list(argv), search_dir, slot
        self.max_restarts, self.image = max_restarts, image

    def __repr__(self) -> str:
        return f"SearchTask(slot={self.slot}, {self.search_dir!r})"

    def __call__(self) -> dict[str, Any]:
        from pathlib import Path

        from trainer.distributed.environment import select_environment
        from trainer.search.study import claim_trial, is_finished
        folder = Path(self.search_dir)
        asks = bool(self.max_restarts) or select_environment().rank == 0     # the batch step is one process
        claim = claim_trial(folder, self.slot, asks=asks)
        if is_finished(folder, claim):      # every rank reads it alike: none trains a trial already told
            return dict(status="told before", trial=claim.trial, run_dir=claim.run_dir)
        argv = [*self.argv, "--run-dir", claim.run_dir, "--resume", "auto", *claim.overrides]
        inner = SupervisedTask(argv, self.max_restarts, self.image) if self.max_restarts else TrainTask(argv)
        try:
            summary = inner()
        except Exception:
            if asks:
                finish_trial(folder, claim)         # failed: its exit record says why
            raise
        summary["trial"] = claim.trial
        if asks and summary.get("status") != "preempted":      # preempted (in process): it comes back for more
            summary["told"] = finish_trial(folder, claim)
        return summary

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Requeued (submitit, rank 0): the same task again; its claim makes it continue the same trial."""
        import submitit
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def finish_trial(search_dir, claim) -> str:
    """Tell the study how the trial's run ended, read from its run directory as `trainer runs` reads it: completed
    (its best value of the metric), pruned, or failed (any other end: the study goes on without it). Returns the
    state told."""
    from pathlib import Path

    from trainer.cli.runs import read_run
    from trainer.search.space import Space
    from trainer.search.study import open_study, optuna, read_manifest
    o = optuna()
    manifest = read_manifest(search_dir)
    study = open_study(search_dir, Space.from_dict(manifest["space"]))
    if study.trials[claim.trial].state.is_finished():
        return study.trials[claim.trial].state.name.lower()
    row = read_run(Path(claim.run_dir), (manifest["metric"], manifest["mode"]))
    if row.state in ("preempted", "running"):     # requeued, or its restart loop goes on: the trial is not over
        return row.state
    if row.state == "completed" and row.best is not None:
        study.tell(claim.trial, row.best)
        told = "complete"
    elif row.state == "pruned":
        study.tell(claim.trial, state=o.trial.TrialState.PRUNED)
        told = "pruned"
    else:
        why = row.cause or (f"no validation value of {manifest['metric']}" if row.state == "completed" else row.state)
        study.tell(claim.trial, state=o.trial.TrialState.FAIL)
        log.warning("search: trial %d failed: %s (the study goes on without it)", claim.trial, why)
        told = "fail"
    value = f" ({row.metric} {row.best:.6g})" if told == "complete" else ""
    log.info("search: trial %d %s%s", claim.trial, told, value)
    return told

"""The owner of one training run, in explicit phases: __init__ builds the run's parts once, in one place (the run,
its checkpoints, the metrics writer, the losses, the components); fit() runs the epochs (each epoch's steps in the
EpochLoop of loop.py, then its end: evaluation, the best checkpoint, early stopping), the components' stops and the
finish (final checkpoint, test split); save() writes a checkpoint; close() tears the parts down.

    with Trainer(recipe, dist_info, cfg, planned, commit) as trainer:     # cfg: trainer.config.settings.Config
        result = trainer.fit()                                             # FitResult

A new concern of a run is a component (trainer/engine/callbacks.py): one class in trainer/engine/components/ with
its from_run(context) and one entry in BUILT_IN, or register_component() in a plugin module (an entry point in the
group hpc_trainer.plugins, or TRAINER_PLUGINS).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from trainer.config.settings import Config
from trainer.distributed import preflight
from trainer.distributed.runtime import DistInfo
from trainer.engine.build import Run, build_run
from trainer.engine.callbacks import (
    C,
    Component,
    ComponentFactory,
    Stop,
    component_states,
    load_component_states,
    registered_components,
)
from trainer.engine.capabilities import EpochPlan, of
from trainer.engine.checkpointer import Checkpointer
from trainer.engine.components.budget import ShutdownBudget
from trainer.engine.components.eviction import Eviction
from trainer.engine.components.hang_watch import HangWatch
from trainer.engine.components.limits import StepLimit
from trainer.engine.components.logging_window import LoggingWindow
from trainer.engine.components.periodic import PeriodicSaves
from trainer.engine.components.profiler import StepProfiler
from trainer.engine.components.progress import FirstStep, ProgressBar
from trainer.engine.components.search_trial import SearchTrial
from trainer.engine.components.stragglers import Stragglers
from trainer.engine.components.tracking import Tracker
from trainer.engine.device_clock import DeviceClock
from trainer.engine.evaluation import Evaluations
from trainer.engine.exits import exit_cause, exit_code_of, exit_of
from trainer.engine.logging import MetricsWriter
from trainer.engine.loop import EpochLoop
from trainer.engine.meters import Throughput
from trainer.engine.preemption import PreemptionHandler
from trainer.engine.recipe import Recipe
from trainer.engine.result import FitResult
from trainer.engine.resume import Planned, write_resume_record
from trainer.engine.selection import Selection, refuse_unknown_metric
from trainer.engine.state import TrainState
from trainer.engine.window import TrainLosses
from trainer.engine.write_failures import WriteFailures, watch
from trainer.launch.exitcodes import PREEMPTED_MARKER, UnfitHostError
from trainer.native.trackers import check_installed

log = logging.getLogger(__name__)

# the built-in components, each built from the run as a plugin's is (register_component), in the order the loops call
# them (a component's Stop ends a step's calls): the device clock first (its step is filed before the window reads
# it), the straggler watch before the window that reads it (it has no hook of its own), eviction last
EARLY_STOP = Stop("early stopping")       # train.early_stop_patience: the run ends as after its last epoch
BUILT_IN: tuple[ComponentFactory, ...] = (
    DeviceClock.from_run, HangWatch.from_run, PreemptionHandler.from_run, StepProfiler.from_run,
    ShutdownBudget.from_run, Stragglers.from_run, LoggingWindow.from_run, ProgressBar.from_run, FirstStep.from_run,
    PeriodicSaves.from_run, StepLimit.from_run, Eviction.from_run, Tracker.from_run, SearchTrial.from_run)


def check_hosts(run: Run, run_dir: Path, slow: float) -> None:
    """The pre-flight (trainer/distributed/preflight.py) judged by SLOW (preflight.slow_fraction): RUN_DIR/
    preflight.json and a summary line; unfit hosts stop the run (UnfitHostError, exit 5), which the restart loop
    relaunches without them."""
    need = run.footprint.total if run.footprint is not None else 0
    verdict = preflight.run_checks(run.info, need, run.amp_dtype or torch.float32, slow=slow)
    if run.info.is_main:
        preflight.write_report(run_dir, verdict)
        (log.warning if verdict.unfit or verdict.notes else log.info)("%s", verdict.summary())
    if verdict.unfit:
        raise UnfitHostError(verdict.unfit)


class Trainer:
    """One training run's parts, built in a fixed order (the RNG streams of a resumed run depend on it); every check
    that can refuse the run comes before commit(), the run directory's first writes (session.run_train's)."""

    def __init__(self, recipe: Recipe, info: DistInfo, cfg: Config, planned: Planned | None = None,
                 commit: Callable[[], None] | None = None):
        """planned: what trainer.engine.resume.check_resume_config found (the settings a resume changes and the
        checkpoint to load); None: the Checkpointer looks for it itself."""
        if info.restart_count:
            log.info("restart %d of job %s (launcher %s)", info.restart_count, info.job_id, info.launcher)
        self.info, self.cfg, self.run_dir = info, cfg, Path(cfg.run_dir)
        checked = preflight.wanted(cfg.faults.preflight, info)
        slow = preflight.slow_fraction(cfg.faults.preflight_slow) if checked else None   # a bad setting refuses here
        self.run = build_run(recipe, info, cfg)
        refuse_unknown_metric(recipe, cfg)
        if info.is_main:
            check_installed(cfg.log.tracker)    # a tracker's missing extra refuses the run before it writes
        self.ckpts = Checkpointer(self.run, self.run_dir, planned)
        resumed = self.ckpts.resume()           # the last check that can refuse the run: nothing written before it
        if commit is not None:
            commit()
        self.ckpts.write_id_maps()
        if info.is_main:
            (self.run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        if checked:
            check_hosts(self.run, self.run_dir, slow)
        self.state, metrics = resumed or (TrainState(), {})
        # a resumed run logs again from the step after its checkpoint: TensorBoard drops what an earlier attempt
        # logged from there on (a crash after the checkpoint leaves such steps behind)
        self.failures = WriteFailures()         # a write failed mid-run: every rank stops alike, exit 4
        watch(self.failures)
        self.writer = MetricsWriter(self.run_dir, info, cfg.log.tensorboard,
                                    purge_step=self.state.global_step + 1 if resumed else None,
                                    failures=self.failures)
        self.components: list[Component] = []
        try:
            if resumed:
                write_resume_record(self.writer, self.state, list(planned.changes) if planned else [],
                                    self.ckpts.notes)
            self.evaluations = Evaluations(self.run, self.state, self.writer, metrics)
            self.meter = Throughput(self.run.device)
            self.losses = TrainLosses(self.run.device, info, max(cfg.log.every_steps, 1) * self.run.accum,
                                      self.state, self.ckpts.last_good)
            self._components()
        except BaseException:
            self.close()
            raise

    def _components(self) -> list[Component]:
        """BUILT_IN's components, then the plugins', each built from this run (a RunContext) in that order; their
        states resumed from the checkpoint."""
        for factory in (*BUILT_IN, *registered_components()):
            component = factory(self)
            if component is not None:
                self.components.append(component)
        self.run.phases.bind(self.components)
        load_component_states(self.components, self.ckpts.component_states)
        self.writer.listeners = [c.logged for c in self.components if type(c).logged is not Component.logged]
        return self.components

    def component(self, kind: type[C]) -> C | None:
        """The run's component of this type (the first built), or None."""
        return next((c for c in self.components if isinstance(c, kind)), None)

    def fit(self) -> FitResult:
        """Train until the configured end, early stopping, or a component's stop (a signal's checkpoint, an
        eviction, ...)."""
        self.selection = Selection(self.run.recipe, self.cfg, self.state)
        self.epoch_loop = EpochLoop(self.run, self.state, self.meter, self.losses, self.components)
        for component in self.components:
            component.fit_start()
        try:
            result = self._epochs()
        finally:
            for component in self.components:
                component.fit_end()
        self.failures.agree(self.info)          # a write failed after the last agreement: every rank stops with it
        return result

    def _epochs(self) -> FitResult:
        state, epochs, recipe = self.state, self.cfg.train.epochs, of(self.run.recipe, EpochPlan)
        status = "completed"
        if state.epoch >= epochs:       # --epochs 0, or a resume of a run already done
            log.warning("no training ran: the run is at epoch %d and --epochs is %d (step %d); the final "
                        "checkpoint and test below are of %s", state.epoch, epochs, state.global_step,
                        "the resumed weights" if state.global_step else "untrained weights")
        while state.epoch < epochs:
            epoch = state.epoch
            with self.run.phases.long("recipe.on_epoch_start"):
                recipe.on_epoch_start(epoch, self.run.model)
            stop = self.epoch_loop.train_epoch(epoch)
            if stop is not None and stop.ends_run:
                return self._stopped(stop)
            if stop is not None and state.batch_in_epoch < self.epoch_loop.end:
                break                   # mid-epoch: no end-of-epoch work for a part of an epoch
            ended = self._end_epoch(epoch)
            if ended is not None and ended.ends_run:
                return self._stopped(ended)
            if ended is not None:
                status = "early_stopped"
                break
            if stop is not None:
                break
        return self._finish(status)

    def _stopped(self, stop: Stop) -> FitResult:
        """A component's stop with an exit code: a checkpoint of where the run is, then the stop's own end."""
        state = self.state
        log.warning("%s: checkpointing at epoch %d step %d%s", stop.reason, state.epoch, state.global_step,
                    stop.detail)
        self.save("periodic")
        result = (stop.then() if stop.then is not None else None) or \
            FitResult("stopped", code=stop.code, reason=stop.reason)
        result.global_step, result.metrics = state.global_step, self.evaluations.last_metrics
        return result

    def _end_epoch(self, epoch: int) -> Stop | None:
        """Evaluate, track the best, let the components act (periodic checkpoints); a Stop when early stopping
        triggers or a component's evaluated() ends the run (a search trial pruned)."""
        state, tc, recipe = self.state, self.cfg.train, of(self.run.recipe, EpochPlan)
        with self.run.phases.long("recipe.on_epoch_end"):
            recipe.on_epoch_end(epoch, self.run.model)
            extra = recipe.epoch_metrics()
        if extra:
            self.writer.write("train", epoch, state.global_step, extra)
        state.epoch, state.batch_in_epoch, state.sample_in_epoch = epoch + 1, 0, 0
        last = state.epoch >= tc.epochs
        if "val" in self.run.eval_sets and (state.epoch % max(tc.eval_every_epochs, 1) == 0 or last):
            if self.selection.record(self.evaluations.evaluate("val", epoch)) and self.cfg.ckpt.save_best:
                self.save("best")
        stops = [component.evaluated(epoch, last) for component in self.components]
        stop = next((s for s in stops if s is not None), None)
        if stop is not None:
            return stop
        patience = tc.early_stop_patience
        if patience > 0 and state.bad_epochs >= patience:
            log.info("early stopping: %s did not improve for %d evaluations", self.selection.metric, patience)
            return EARLY_STOP
        return None

    def _finish(self, status: str) -> FitResult:
        """Final checkpoint, then the test split with the final and (if any) the best weights."""
        state, evaluations = self.state, self.evaluations
        self.save("final")
        epoch = max(state.epoch - 1, 0)
        if "test" in self.run.eval_sets:
            evaluations.evaluate("test", epoch, checkpoint="final")
            best = self.ckpts.dir / "best.pt"
            if self.cfg.ckpt.save_best and best.exists():
                evaluations.last_metrics["test_best"] = evaluations.test_best(best, epoch)
        log.info("training %s after %d steps", status, state.global_step)
        if self.info.is_main:
            self._where_it_is()
        return FitResult(status, 0, False, state.global_step, evaluations.last_metrics)

    def _where_it_is(self) -> None:
        """The run's last lines: its directory, checkpoint files and the TensorBoard command."""
        folder = self.ckpts.dir
        log.info("run directory: %s", self.cfg.run_dir)
        log.info("checkpoints: %s (in %s)", ", ".join(sorted(p.name for p in folder.glob("*.pt"))) or "none", folder)
        if self.cfg.log.tensorboard:
            log.info("TensorBoard: tensorboard --logdir %s", Path(self.cfg.run_dir) / "tb")

    def save(self, kind: str) -> None:
        """A checkpoint of `kind` (periodic, best, final), after the losses' read that covers its steps; the
        components' states go with it."""
        self.losses.read()
        self.run.phases.tell("save_start", kind)
        t0 = time.perf_counter()
        with self.run.phases.long("checkpoint"):
            self.ckpts.save(kind, self.state, self.evaluations.last_metrics, component_states(self.components))
        seconds = time.perf_counter() - t0
        self.failures.agree(self.info)          # a failed log or metrics write stops every rank, after the save
        for component in self.components:
            component.saved(seconds)

    def fit_and_tell(self) -> FitResult:
        """fit(), then each component told how the run ends (Component.exited: the exit record's code and cause),
        an error included, before close()."""
        try:
            result = self.fit()
        except BaseException as err:
            self.exited(exit_of(err).code, exit_cause(err))
            raise
        self.exited(exit_code_of(result), result.reason or result.status)
        return result

    def exited(self, code: int, cause: str) -> None:
        for component in self.components:
            component.exited(code, cause)

    def close(self) -> None:
        """Tear the run's parts down (the profiler's trace written, the writer closed)."""
        for component in self.components:
            component.close()
        self.writer.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

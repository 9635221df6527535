"""What the loops call besides stepping: a run's components, each a concern of its own (the loss window's read and
the signal agreement, the straggler watch, the profiler, periodic saves, eviction, the shutdown budget, ...), built
once by the run's owner (trainer/engine/trainer.py) and called by the loops at fixed points, in their order.

    class StepCount(Component):                       # a new concern: one class, one registration line
        def step_end(self, step: StepEnd) -> Stop | None:
            self.steps += 1
            return None                               # or a Stop: the epoch loop stops there
    register_component(lambda trainer: StepCount())   # in a plugin module (docs/extending.md)

A component overrides only the hooks it needs; the defaults do nothing. A plugin module is found by its entry point
(group hpc_trainer.plugins) or named in TRAINER_PLUGINS; it may add its own config section
(trainer.config.settings.register_section) and read it from the owner's cfg.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from trainer.engine.result import FitResult

log = logging.getLogger(__name__)
C = TypeVar("C", bound="Component")


@dataclass(frozen=True)
class Stop:
    """A component's request, from its step_end, to end the epoch's steps after this step: why, in words (the log
    and each rank's exit record), and how the run ends. Open: a component makes its own.

    code 0: the run ends as it would after its last step (the epoch's end-of-epoch work where this step ended the
    epoch, the final checkpoint, the test split): train.max_steps. Any other code: a checkpoint of where the run is,
    so that a resume goes on from the next step, then `then()` if given (it may raise: an eviction's exit 5, or
    return the run's result: a preemption's requeue), else the process exits with `code`. Every rank must ask for
    the same stop at the same step (a decision from a collective, or from what every rank counts alike)."""

    reason: str                   # e.g. "received SIGUSR1", "tally: stopped at step 12"
    code: int = 0
    detail: str = ""              # appended to the checkpoint's log line (how long the signal waited)
    then: Callable[[], FitResult | None] | None = field(default=None, compare=False)

    @property
    def ends_run(self) -> bool:
        """A checkpointed stop with an exit code (not the run's normal end)."""
        return self.code != 0 or self.then is not None


@dataclass(frozen=True)
class StepEnd:
    """An optimizer step just ended: where (epoch; micro-batches of the epoch done and where it ends; optimizer steps
    done) and what it took on the host (its wall time, and the part of it spent waiting in the gradient collectives,
    0 where unmeasured)."""

    epoch: int
    micro: int
    end: int
    step: int
    seconds: float
    waited: float = 0.0

    @property
    def epoch_done(self) -> bool:
        """This step ended the epoch (its end-of-epoch work follows: evaluation, checkpoints)."""
        return self.micro == self.end


class Component:
    """A part of a run that the loops call; every hook is optional. Order: the owner's registration order; the first
    step_end that returns a Stop ends that step's calls (later components wait for the next step).

    State that must survive a resume: state_dict() goes into every checkpoint under the component's state_key
    (rank 0's, as the model's: a state every rank holds alike), and load_state_dict() gets it back on resume, after
    the component is built; a checkpoint without it (written before the component existed) leaves it fresh."""

    state_key: str = ""           # where its state_dict goes in a checkpoint ("": the class name)

    def fit_start(self) -> None:
        """The run's owner is about to run the fit loop (its parts built, the checkpoint resumed)."""

    def fit_end(self) -> None:
        """The fit loop ended (normally or by an exception); close() follows when the run is torn down."""

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        """EpochLoop: before the epoch's first step (first: the micro-batch it starts at, end: where it ends)."""

    def step_start(self, epoch: int, micro: int) -> None:
        """EpochLoop: an optimizer step begins at this micro-batch of the epoch (before its data is moved)."""

    def step_end(self, step: StepEnd) -> Stop | None:
        """EpochLoop: after each optimizer step; a Stop ends the epoch's steps there."""
        return None

    def epoch_end(self, epoch: int, stop: Stop | None) -> None:
        """EpochLoop: after the epoch's last step, whatever stopped it (None: the epoch ran out)."""

    def evaluation_start(self, split: str) -> None:
        """An evaluation of `split` (val, test) begins: before the recipe's on_evaluation_start."""

    def evaluation_batch(self, split: str) -> None:
        """One evaluation batch of this rank's shard is done (the shards may differ by one batch)."""

    def evaluation_end(self, split: str, metrics: dict[str, Any]) -> None:
        """The evaluation of `split` is done; every rank has its metrics."""

    def evaluated(self, epoch: int, last: bool) -> Stop | None:
        """The run's owner: the epoch is counted and validated (last: it was the run's last epoch). A Stop ends the
        run there, as step_end's does (code 0: as early stopping; any other: a checkpoint, then that exit), after
        every component has heard of the epoch; the first one's wins. Every rank must return the same."""
        return None

    def save_start(self, kind: str) -> None:
        """The run's owner begins a checkpoint of `kind` (periodic, best, final)."""

    def saved(self, seconds: float) -> None:
        """The run's owner wrote a checkpoint; it took `seconds` (the save's end)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a resume must give back (tensors, numbers, strings, lists, dicts); None: nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume, what state_dict() returned when the checkpoint was written."""

    def marked(self, where: str, schedule: bool = True) -> None:
        """The run passed a point (Phases.mark): schedule, one that every rank passes in the same order (a batch in
        hand, a backward begun, an evaluation done); else one that ranks pass as many times as their share holds
        (an evaluation batch: the shards may differ by one)."""

    def phase_start(self, what: str) -> None:
        """A long phase of the run began (a recipe's hook, a checkpoint written, an evaluation's start): Phases.long."""

    def phase_end(self, what: str) -> None:
        """That long phase ended (normally or by an exception)."""

    def logged(self, record: dict[str, Any]) -> None:
        """Rank 0: a record was appended to metrics.jsonl (split, epoch, step, time, its metrics; a train step
        logged before a resume went back behind it carries redone=True)."""

    def exited(self, code: int, cause: str) -> None:
        """How the run ends, as its exit record will say (the exit code, its cause), before close()."""

    def close(self) -> None:
        """The run ends (normally or not): release what the component holds."""


def state_key(component: Component) -> str:
    return component.state_key or type(component).__name__


def component_states(components) -> dict[str, Any]:
    """Every component's state_dict that is not None, by its state_key (a checkpoint's `components`)."""
    states = {}
    for component in components:
        state = component.state_dict()
        if state is not None:
            key = state_key(component)
            if key in states:
                raise ValueError(f"two components keep their state under {key!r}: give one a state_key of its own")
            states[key] = state
    return states


def load_component_states(components, states: dict[str, Any] | None) -> None:
    """A resumed checkpoint's states (None: a fresh start) back into the components that kept them; one that the
    checkpoint does not hold (written before the component existed) starts fresh, said once."""
    if states is None:
        return
    for component in components:
        if type(component).load_state_dict is Component.load_state_dict:
            continue
        key = state_key(component)
        if key in states:
            component.load_state_dict(states[key])
        else:
            log.info("the checkpoint holds no state of %s: it starts fresh", key)


class RunContext(Protocol):
    """What a component factory (the built-ins' from_run, a plugin's) reads from the run's owner
    (trainer/engine/trainer.py Trainer): the run built (trainer.engine.build.Run), its state (TrainState: epoch,
    global_step, ...), the resolved config (plugin sections included), the launch facts, the run directory, the
    metrics writer, the device-side losses (window.TrainLosses), the throughput meter, the write-failure flag,
    save(kind) for a checkpoint, and the components built so far (in order) with component(kind), the one of a type."""

    run: Any
    state: Any
    cfg: Any
    info: Any
    run_dir: Path
    writer: Any
    losses: Any
    meter: Any
    failures: Any
    components: list[Component]

    def save(self, kind: str) -> None: ...

    def component(self, kind: type[C]) -> C | None: ...


ComponentFactory = Callable[[RunContext], "Component | None"]     # the run's owner -> a component, or None
_EXTRA: list[ComponentFactory] = []


def register_component(factory: ComponentFactory) -> ComponentFactory:
    """Add a component to every run of this process, after the built-in ones: factory(context) is called once per
    run with its owner (a RunContext) and returns the component, or None to stay out of that run. The same factory
    registered twice (a module imported again) counts once."""
    if factory not in _EXTRA:
        _EXTRA.append(factory)
    return factory


def registered_components() -> tuple[ComponentFactory, ...]:
    return tuple(_EXTRA)


class Phases:
    """Where a run is, told by the engine to the components that listen (Component.marked, phase_start/phase_end):
    the loops mark the points every rank passes in the same order, and wrap every long phase that is not a step (each
    recipe hook, a checkpoint, an evaluation's start) in long(), so that a recipe need not remember to."""

    def __init__(self, components: Sequence[Component] = ()):
        self.bind(components)

    TOLD = ("step_start", "evaluation_start", "evaluation_batch", "evaluation_end", "save_start")

    def bind(self, components: Sequence[Component]) -> None:
        """Listen with these components (only those that override a hook are called: a mark costs nothing else)."""
        self._marks = [c for c in components if type(c).marked is not Component.marked]
        self._phases = [c for c in components if type(c).phase_start is not Component.phase_start
                        or type(c).phase_end is not Component.phase_end]
        self._told = {hook: [getattr(c, hook) for c in components
                             if getattr(type(c), hook) is not getattr(Component, hook)] for hook in self.TOLD}

    def tell(self, hook: str, *args: Any) -> None:
        """Call one of the TOLD hooks on the components that override it."""
        for call in self._told[hook]:
            call(*args)

    def mark(self, where: str, schedule: bool = True) -> None:
        for component in self._marks:
            component.marked(where, schedule)

    @contextlib.contextmanager
    def long(self, what: str) -> Iterator[None]:
        for component in self._phases:
            component.phase_start(what)
        try:
            yield
        finally:
            for component in self._phases:
                component.phase_end(what)

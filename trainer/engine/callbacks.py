"""What the loops call besides stepping: a run's components, each a concern of its own (the loss window's read and
the signal agreement, the straggler watch, the profiler, periodic saves, eviction, the shutdown budget, ...), built
once by the run's owner (trainer/engine/trainer.py) and called by the loops at fixed points, in their order.

    class StepCount(Component):                       # a new concern: one class, one registration line
        def step_end(self, step: StepEnd) -> Stop | None:
            self.steps += 1
            return None                               # or a Stop: the epoch loop stops there
    register_component(lambda trainer: StepCount())   # e.g. in a TRAINER_PLUGINS module

A component overrides only the hooks it needs; the defaults do nothing.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence


class Stop(enum.Enum):
    """Why the epoch loop's steps ended (EpochLoop.train_epoch)."""

    EPOCH_DONE = "epoch done"
    SIGNAL = "signal"             # an agreed preemption signal (the logging window's `signal` names it)
    MAX_STEPS = "max steps"       # train.max_steps reached
    EVICT = "evict"               # a straggler named under train.straggler_action=evict (Eviction.evicted)


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
    step_end that returns a Stop ends that step's calls (later components wait for the next step)."""

    def epoch_start(self, epoch: int, first: int, end: int) -> None:
        """EpochLoop: before the epoch's first step (first: the micro-batch it starts at, end: where it ends)."""

    def step_end(self, step: StepEnd) -> Stop | None:
        """EpochLoop: after each optimizer step; a Stop ends the epoch's steps there."""
        return None

    def epoch_end(self, epoch: int, stop: Stop) -> None:
        """EpochLoop: after the epoch's last step, whatever stopped it."""

    def evaluated(self, epoch: int, last: bool) -> None:
        """FitLoop: the epoch is counted and validated (last: it was the run's last epoch)."""

    def saved(self, seconds: float) -> None:
        """The run's owner wrote a checkpoint; it took `seconds`."""

    def marked(self, where: str, schedule: bool = True) -> None:
        """The run passed a point (Phases.mark): schedule, one that every rank passes in the same order (a batch in
        hand, a backward begun, an evaluation done); else one that ranks pass as many times as their share holds
        (an evaluation batch: the shards may differ by one)."""

    def phase_start(self, what: str) -> None:
        """A long phase of the run began (a recipe's hook, a checkpoint written, an evaluation's start): Phases.long."""

    def phase_end(self, what: str) -> None:
        """That long phase ended (normally or by an exception)."""

    def close(self) -> None:
        """The run ends (normally or not): release what the component holds."""


ComponentFactory = Callable[[Any], "Component | None"]     # the run's owner (Trainer) -> a component, or None
_EXTRA: list[ComponentFactory] = []


def register_component(factory: ComponentFactory) -> ComponentFactory:
    """Add a component to every run of this process, after the built-in ones: factory(trainer) is called once per
    run with its owner (trainer.run, .state, .cfg, .info, .writer, .save) and returns the component, or None to stay
    out of that run. The same factory registered twice (a module imported again) counts once."""
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

    def bind(self, components: Sequence[Component]) -> None:
        """Listen with these components (only those that override a hook are called: a mark costs nothing else)."""
        self._marks = [c for c in components if type(c).marked is not Component.marked]
        self._phases = [c for c in components if type(c).phase_start is not Component.phase_start
                        or type(c).phase_end is not Component.phase_end]

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

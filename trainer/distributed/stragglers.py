"""Stragglers named while training: each rank's own time per optimizer step (the window's time minus its waits in
collectives: DDP's gradient all-reduce as gradsync's hook times it, and the loop's own agreements) rides in the
collective the loop already makes at each logging window, with the signal flags; a rank at FACTOR or more of the
other ranks' median for WINDOWS judged windows in a row (each at least JUDGED_S long) is named (rank, host, factor).

    watch = StragglerWatch(hosts=["node1", "node1", "node2", "node2"])
    slots = window_slots(info, own_s=0.031, wall_s=0.040)      # this rank's part of the window's collective
    fields, named = watch.observe(own_times(summed, world=4))   # every rank gets the same answer: no vote needed

The figures a window sends are those of the window before it (its clock is read when the window is logged, after
the window's one host sync), so a GPU's CUDA-event window time is read without a sync of its own; naming takes
WINDOWS + 1 judged windows from the slowdown. Own time counts a rank's data loading, forward, backward and optimizer
step: a rank slowed by its node (a slower GPU, a shared core, a slow disk) shows it; a rank waiting for it does not.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from trainer.distributed.runtime import DistInfo

log = logging.getLogger(__name__)

FACTOR = 2.0     # a rank at twice the others' median: this machine's noise between ranks is 1.2-1.5x, a slowed node 3x
WINDOWS = 3      # judged windows in a row
JUDGED_S = 1.0   # a judged window spans at least this much of rank 0's wall time (shorter logging windows add up)


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    factor: float        # its own time per step over the other ranks' median, in the last window
    windows: int         # windows in a row at FACTOR or more
    evictable: bool      # some rank runs on another host (leaving this host out leaves a world)

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host} took {self.factor:.2f}x the other ranks' median time per step "
                f"(without waits) for {self.windows} logging windows in a row")


def window_slots(info: DistInfo, own_s: float, wall_s: float) -> torch.Tensor:
    """This rank's part of the window's sum: its own seconds per step in its slot, rank 0's wall seconds per step
    in the last (the one figure every rank then agrees on, for the signal agreement's cadence)."""
    slots = torch.zeros(info.world_size + 1, dtype=torch.float64)
    slots[info.rank] = own_s
    if info.rank == 0:
        slots[-1] = wall_s
    return slots


def own_times(summed: list[float], world: int) -> tuple[list[float], float]:
    """window_slots summed over the ranks: each rank's own seconds per step, and rank 0's wall seconds per step."""
    return list(summed[:world]), summed[world]


class StragglerWatch:
    """Streaks of windows per rank at FACTOR or more of the others' median."""

    def __init__(self, hosts: list[str], factor: float = FACTOR, windows: int = WINDOWS):
        self.hosts, self.factor, self.windows = hosts, factor, windows
        self.streak = [0] * len(hosts)

    def observe(self, own: list[float]) -> tuple[dict, Straggler | None]:
        """One window's own times per rank (0: not measured yet, as in a run's first window): the fields of the
        train record (the slowest rank and its factor; the straggler's while one is named) and the straggler named
        in this window, if any (once per streak)."""
        if len(own) < 2 or min(own) <= 0:
            return {}, None
        factors = [v / statistics.median(own[:r] + own[r + 1:]) for r, v in enumerate(own)]
        self.streak = [s + 1 if f >= self.factor else 0 for s, f in zip(self.streak, factors)]
        slowest = max(range(len(own)), key=factors.__getitem__)
        fields = dict(slowest_rank=slowest, slowest_factor=round(factors[slowest], 3))
        if self.streak[slowest] < self.windows:
            return fields, None
        host = self.hosts[slowest]
        fields.update(straggler_rank=slowest, straggler_host=host, straggler_factor=round(factors[slowest], 3))
        if self.streak[slowest] > self.windows:
            return fields, None
        return fields, Straggler(slowest, host, round(factors[slowest], 3), self.streak[slowest],
                                 evictable=any(h != host for h in self.hosts))



def watched(info, action: str) -> bool:
    """Whether a run watches for stragglers (faults.straggler_action): not a single process, not off."""
    return info.distributed and action != "off"


class StepClock:
    """A rank's own time over the optimizer steps since the last judged window: their wall time (data loading,
    forward, backward, optimizer step; not the boundary work after a step: agreements, checkpoints) minus what they
    waited in collectives inside them (the gradient all-reduce as gradsync's timer gives it). On the CPU the host
    clock times each step (step(), waited()); on a GPU a window's CUDA-event time is added whole (add()).

    mark() at a window's log fixes what the next window's collective sends (figures()); a window whose sent steps
    span at least JUDGED_S of rank 0's wall time is judged, and judged() drops what it covered. Shorter ones add up:
    a 1-step window of a 2 ms step is scheduling noise, a second of steps is not."""

    def __init__(self):
        self.wall, self.waits, self.steps = 0.0, 0.0, 0
        self.marked = (0.0, 0.0, 0)

    def step(self, wall_s: float) -> None:
        self.wall += wall_s
        self.steps += 1

    def waited(self, seconds: float) -> None:
        self.waits += seconds

    def add(self, wall_s: float, waited_s: float, steps: int) -> None:
        self.wall, self.waits, self.steps = self.wall + wall_s, self.waits + waited_s, self.steps + steps

    def mark(self) -> None:
        self.marked = (self.wall, self.waits, self.steps)

    def figures(self) -> tuple[float, float, int]:
        """Own and wall seconds per step over the marked steps, and their count (zeros before a mark)."""
        wall, waits, steps = self.marked
        return (max(wall - waits, 0.0) / steps, wall / steps, steps) if steps else (0.0, 0.0, 0)

    def judged(self) -> None:
        wall, waits, steps = self.marked
        self.wall, self.waits, self.steps = self.wall - wall, self.waits - waits, self.steps - steps
        self.marked = (0.0, 0.0, 0)


def report(records: list[dict]) -> str:
    """`doctor --run`'s lines from the train records of metrics.jsonl: the stragglers named (first step, rank,
    host, largest factor) and the largest factor of any judged window (what a healthy run shows)."""
    judged = [r for r in records if "slowest_factor" in r]
    if not judged:
        return "  stragglers: none judged (a single process, faults.straggler_action=off, or windows too short)"
    top = max(judged, key=lambda r: r["slowest_factor"])
    lines = [f"  stragglers: {len(judged)} judged window(s); the largest factor {top['slowest_factor']:.2f}x "
             f"(rank {top['slowest_rank']}, step {top['step']}; named at {FACTOR:g}x for {WINDOWS} in a row)"]
    named: dict[tuple, list[dict]] = {}
    for r in records:
        if "straggler_rank" in r:
            named.setdefault((r["straggler_rank"], r["straggler_host"]), []).append(r)
    for (rank, host), rows in named.items():
        lines.append(f"  straggler: rank {rank} on {host} from step {rows[0]['step']}, up to "
                     f"{max(x['straggler_factor'] for x in rows):.2f}x the other ranks' median")
    return "\n".join(lines)

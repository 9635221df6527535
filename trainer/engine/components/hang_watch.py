"""The hang watch: a thread per rank that finds a group making no progress in minutes, not after the process
group's timeout (dist.timeout_s, 30 minutes by default). Every rank publishes its heartbeat (trainer/distributed/
heartbeats.py): its progress (each mark the engine passes: a batch in hand, a backward begun, a step done, an
evaluation batch; and every tick of its watch while a long phase lasts: a recipe hook, a checkpoint, an evaluation's
start), its position (the marks alone: equal on every rank at the same point of the schedule they all follow) and its
watch's tick. When no rank has made progress for faults.hang_timeout_s, or one rank's watch has been silent that long,
each rank that can still tell dumps its threads' stacks (and, under NCCL, the flight recorder) into RUN_DIR/hangs/,
names the culprit by one rule that every rank applies to the same heartbeats (blame() below), records its exit and
exits HANG (6), which the restart loop relaunches from the last agreed checkpoint. A watch that finds its own loop
paused (the job suspended by `scontrol suspend`, the process stopped) judges the group again from then.

    watch = HangWatch(info, run_dir, timeout_s=0)      # 0: auto, max(60 s, 20 x the slowest step); < 0: off
    watch.step_end(step)                               # progress (Component hooks: step_end, marked, phase_*)
    with Phases([watch]).long("checkpoint"): save()    # a long phase on one rank is progress, not a hang
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

from trainer.distributed.heartbeats import Beat, HeartbeatBoard
from trainer.distributed.runtime import DistInfo
from trainer.engine.callbacks import Component, Phases, RunContext, StepEnd, Stop
from trainer.launch.exitcodes import HANG, record_exit

log = logging.getLogger(__name__)
FLOOR_S = 60.0           # the automatic timeout is never under a minute
STEPS = 20               # ... nor under this many of the slowest step seen
HANGS_DIR = "hangs"
CLOSED = -1              # the tick of a watch whose run ended
STEP_MARKS = ("batch", "forward", "backward")     # the epoch loop's marks inside a step


def auto_timeout(slowest_step_s: float) -> float:
    return max(FLOOR_S, STEPS * slowest_step_s)


def blame(beats: dict[int, Beat], silent: dict[int, float], world: int) -> tuple[list[int], str]:
    """The ranks to blame for the group's hang and why, from what every rank reads alike: the heartbeats, whose
    values stopped changing long before the verdict, and which watches went silent. ([], why): no single rank is.
    silent: the ranks whose watch has not ticked for several periods (stopped, or stuck outside Python holding the
    interpreter), with how long; a rank never seen counts as silent."""
    if silent:
        named = sorted(silent)
        return named, (f"its hang watch has been silent for {max(silent.values()):.0f} s (stopped, or stuck "
                       f"outside Python)" if len(named) == 1 else
                       f"the hang watches of ranks {', '.join(map(str, named))} have been silent (stopped, or stuck "
                       f"outside Python)")
    low = min(b.position for b in beats.values())
    behind = sorted(r for r, b in beats.items() if b.position == low)
    if len(behind) == world:
        return [], (f"no single rank is to blame: every rank stalled at the same point ({beats[behind[0]].doing}), "
                    f"with its watch alive (a shared file system, the store, or work every rank does alike)")
    ahead = max(b.position for b in beats.values())
    return behind, (f"it is behind the others (at {beats[behind[0]].doing}; the furthest rank is "
                    f"{ahead - low} mark(s) ahead, at {beats[max(beats, key=lambda r: beats[r].position)].doing}), "
                    f"its watch alive: stuck in Python or in a call that lets go of the interpreter")


class HangWatch(Component):
    """Progress published for the group and the group's progress judged, by a thread of this rank."""

    @classmethod
    def from_run(cls, ctx: RunContext) -> HangWatch | None:
        """The run's hang watch (faults.hang_timeout_s; off in a single process or below 0)."""
        timeout = ctx.cfg.faults.hang_timeout_s
        return cls(ctx.info, ctx.run_dir, timeout) if cls.wanted(ctx.info, timeout) else None

    def __init__(self, info: DistInfo, run_dir: str | Path, timeout_s: float = 0.0, board: HeartbeatBoard | None = None,
                 period_s: float | None = None, exit_fn=os._exit):
        self.info, self.run_dir, self.setting = info, Path(run_dir), timeout_s
        self.progress, self.position, self.steps, self.doing, self.busy_with = 0, 0, 0, "starting", []
        self.slowest_step_s, self.last_step_at = 0.0, None
        self.period_s = period_s or (min(max(timeout_s / 10, 0.5), 5.0) if timeout_s > 0 else 5.0)
        self.board = board or HeartbeatBoard.connect(info, timeout_s=max(self.period_s * 2, 2.0))
        self.exit_fn = exit_fn
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="hang watch")
        if self.board is not None:
            self.thread.start()

    @staticmethod
    def wanted(info: DistInfo, timeout_s: float) -> bool:
        return info.distributed and timeout_s >= 0

    def timeout_s(self) -> float:
        return self.setting if self.setting > 0 else auto_timeout(self.slowest_step_s)

    def frozen_after_s(self) -> float:
        """A pause of the watch's own loop longer than this is this process stopped, not the group hung."""
        return max(3 * self.period_s, 2.0)

    # ---------------------------------------------------------------- progress, from the main thread
    def marked(self, where: str, schedule: bool = True) -> None:
        self.progress += 1          # (three marks a step: nothing formatted here, the watch's tick says it)
        self.position += schedule
        self.doing = where

    def _doing(self) -> str:
        """What this rank is at, for its heartbeat and its dump: a step's mark with the step it belongs to."""
        doing = self.doing
        return f"step {self.steps + 1}: {doing}" if doing in STEP_MARKS else doing

    def step_end(self, step: StepEnd) -> Stop | None:
        now = time.monotonic()
        if self.last_step_at is not None:
            self.slowest_step_s = max(self.slowest_step_s, now - self.last_step_at)
        self.last_step_at = now
        self.steps += 1
        self.marked(f"step {step.step} done")
        return None

    def epoch_end(self, epoch: int, stop: Stop | None) -> None:
        self.last_step_at = None            # evaluation and checkpoints between epochs are not a step's time

    def phase_start(self, what: str) -> None:
        self.busy_with.append(what)
        self.doing = what

    def phase_end(self, what: str) -> None:
        if what in self.busy_with:
            self.busy_with.remove(what)
        self.progress += 1

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A phase of this rank's own work (a checkpoint written, an evaluation): progress while it lasts."""
        with Phases([self]).long(what):
            yield

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * self.period_s + 2)    # its last beat says "closed"

    # ---------------------------------------------------------------- the watch, in its thread
    def _watch(self) -> None:
        tick, seen, progress_at = 0, {}, {}
        reached = last = began = time.monotonic()     # the store answered last; this watch ran last; it started
        tick_at = dict.fromkeys(range(self.info.world_size), began)
        while not self._stop.wait(self.period_s):
            tick += 1
            if self.busy_with:
                self.progress += 1
            now = time.monotonic()
            if now - last > self.frozen_after_s():
                # This process itself was stopped (`scontrol suspend`, a paused VM, a SIGSTOP): every rank's
                # silence was seen through a stopped clock; the group is judged again from now.
                log.warning("rank %d: the hang watch did not run for %.0f s (the job suspended or this process "
                            "stopped): progress is judged again from now", self.info.rank, now - last)
                progress_at = dict.fromkeys(progress_at, now)
                tick_at = dict.fromkeys(tick_at, now)
                reached = now
            last = now
            try:
                self.board.publish(Beat(self.progress, tick, self.position, self._doing()))
                beats = self.board.read()
                reached = now
            except Exception:  # noqa: BLE001 - a store that does not answer is what is being judged
                beats = {}
            told = self._posted() if beats else ""
            if told:                      # another rank judged first: its verdict is the group's
                self._hung(now - max(progress_at.values(), default=now), seen, tick_at, now, 0.0, told)
                return
            for rank, beat in beats.items():
                if beat.tick == CLOSED:
                    tick_at.pop(rank, None)
                    continue
                old = seen.get(rank)
                if old is None or beat.progress != old.progress:
                    progress_at[rank] = now
                if old is None or beat.tick != old.tick:
                    tick_at[rank] = now
                seen[rank] = beat
            # judged once this rank has made its first step: every rank then reached that step's collective, so
            # none is still compiling its first (which may take minutes; dist.timeout_s bounds the start)
            if self.steps == 0 or not progress_at:
                continue
            idle, unreached = now - max(progress_at.values()), now - reached
            silent = {r: now - t for r, t in tick_at.items() if now - t > self.timeout_s()}
            if idle > self.timeout_s() or unreached > self.timeout_s() or silent:
                self._hung(idle, seen, tick_at, now, unreached)
                return
        try:        # a rank whose run ended stops ticking: it says so, and is not taken for a stopped one
            self.board.publish(Beat(self.progress, CLOSED, self.position, "closed"))
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0's exit
            pass

    def _posted(self) -> str:
        try:
            return self.board.verdict()
        except Exception:  # noqa: BLE001 - judged by the rest of the loop
            return ""

    def _hung(self, idle_s: float, seen: dict[int, Beat], tick_at: dict, now: float, unreached_s: float,
              told: str = "") -> None:
        """Name the culprit (one rule, the same on every rank: blame()), post it as the group's verdict (the first
        posted wins: every rank records the same cause), dump this rank's stacks, record the exit and leave once the
        other live ranks have recorded it too (a rank that exits first would end their collectives otherwise)."""
        cause = told or self._cause(idle_s, seen, tick_at, now, unreached_s)
        if not told and unreached_s <= self.timeout_s():
            with contextlib.suppress(Exception):
                cause = self.board.post_verdict(cause)
        self._tell(cause, seen)
        alive = sum(1 for t in tick_at.values() if now - t <= 3 * self.period_s)
        deadline = time.monotonic() + 2 * self.period_s + 2
        with contextlib.suppress(Exception):
            self.board.told()
            while self.board.how_many_told() < alive and time.monotonic() < deadline:
                time.sleep(0.1)
        self.exit_fn(HANG)

    def _cause(self, idle_s: float, seen: dict[int, Beat], tick_at: dict, now: float, unreached_s: float) -> str:
        timeout = self.timeout_s()
        silent = {r: now - t for r, t in tick_at.items() if now - t > max(3 * self.period_s, timeout / 2)}
        if unreached_s > timeout:
            named, why = [0], f"the rendezvous store (on rank 0's host) has not answered for {unreached_s:.0f} s"
        else:
            named, why = blame(seen, silent, self.info.world_size)
        who = ("the group" if not named else f"rank {named[0]}" if len(named) == 1 else
               f"rank {named[0]} (with {', '.join(map(str, named[1:]))})")
        head = f"made no progress, nor did any other rank, for {idle_s:.0f} s" if idle_s > timeout or not silent \
            else f"has been silent for {max(silent.values()):.0f} s while the others waited"
        return f"hang: {who} {head} (faults.hang_timeout_s={timeout:.0f}); {why}"

    def _tell(self, cause: str, seen: dict[int, Beat]) -> None:
        """This rank's stacks into RUN_DIR/hangs/, its exit record, the error line."""
        where = self.run_dir / HANGS_DIR
        try:
            where.mkdir(parents=True, exist_ok=True)
            with open(where / f"rank-{self.info.rank}.txt", "w") as fh:
                fh.write(f"{cause}\nrank {self.info.rank} on {socket.gethostname()} pid {os.getpid()}, "
                         f"last: {self._doing()}\nheartbeats: "
                         + ", ".join(f"rank {r}: {b.progress} at mark {b.position} ({b.doing})"
                                     for r, b in sorted(seen.items()))
                         + "\n\n")
                fh.flush()
                faulthandler.dump_traceback(fh, all_threads=True)
            self._flight_recorder(where)
        except OSError:
            pass
        record_exit(self.run_dir, self.info.rank, HANG, cause)
        log.error("%s. Stacks in %s.\nHINT: the restart loop (slurm/*.sbatch, MAX_RESTARTS) relaunches from the last "
                  "checkpoint; by hand: --resume auto", cause, where)
        for handler in logging.getLogger().handlers:
            handler.flush()

    def _flight_recorder(self, where: Path) -> None:
        """Under NCCL: which collective each rank was in (torch's flight recorder; slurm/common.sh turns it on)."""
        if self.info.backend != "nccl":
            return
        try:
            import torch
            dump = torch._C._distributed_c10d._dump_nccl_trace()
        except Exception:  # noqa: BLE001 - a torch without it, or the recorder off
            return
        (where / f"nccl-rank-{self.info.rank}.pkl").write_bytes(dump)

"""The hang watch: a thread per rank that finds a group making no progress in minutes, not after the process
group's timeout (dist.timeout_s, 30 minutes by default). Every rank publishes its heartbeat (trainer/distributed/
heartbeats.py): progress (each optimizer step, each evaluation batch, a checkpoint being written) and its watch's
tick. When no rank of the group has made progress for train.hang_timeout_s, each rank that can still tell dumps its
threads' stacks (and, under NCCL, the flight recorder) into RUN_DIR/hangs/, names the rank whose heartbeat is oldest
(a stopped rank's watch is stopped too: its tick is the oldest; else the rank whose progress is), records its exit
and exits HANG (6), which the restart loop relaunches from the last agreed checkpoint. A watch that finds its own
loop paused (the job suspended by `scontrol suspend`, the process stopped) judges the group again from then.

    watch = HangWatch(info, run_dir, timeout_s=0)      # 0: auto, max(60 s, 20 x the slowest step); < 0: off
    watch.step_end(step)                              # progress (a Component hook)
    with watch.busy("checkpoint"): save()             # a long phase on one rank is progress, not a hang
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
from trainer.engine.callbacks import Component, StepEnd, Stop
from trainer.launch.exitcodes import HANG, record_exit

log = logging.getLogger(__name__)
FLOOR_S = 60.0           # the automatic timeout is never under a minute
STEPS = 20               # ... nor under this many of the slowest step seen
HANGS_DIR = "hangs"


def auto_timeout(slowest_step_s: float) -> float:
    return max(FLOOR_S, STEPS * slowest_step_s)


class HangWatch(Component):
    """Progress published for the group and the group's progress judged, by a thread of this rank."""

    def __init__(self, info: DistInfo, run_dir: str | Path, timeout_s: float = 0.0, board: HeartbeatBoard | None = None,
                 period_s: float | None = None, exit_fn=os._exit):
        self.info, self.run_dir, self.setting = info, Path(run_dir), timeout_s
        self.progress, self.doing, self.busy_with = 0, "starting", ""
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
    def beat(self, doing: str = "") -> None:
        self.progress += 1
        if doing:
            self.doing = doing

    def step_end(self, step: StepEnd) -> Stop | None:
        now = time.monotonic()
        if self.last_step_at is not None:
            self.slowest_step_s = max(self.slowest_step_s, now - self.last_step_at)
        self.last_step_at = now
        self.beat(f"step {step.step}")
        return None

    def epoch_end(self, epoch: int, stop: Stop) -> None:
        self.last_step_at = None            # evaluation and checkpoints between epochs are not a step's time

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """A phase of this rank's own work (a checkpoint written, an evaluation): progress while it lasts."""
        self.busy_with, self.doing = what, what
        try:
            yield
        finally:
            self.busy_with = ""
            self.beat()

    def close(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- the watch, in its thread
    def _watch(self) -> None:
        tick, seen, progress_at, tick_at, started = 0, {}, {}, {}, False
        reached = last = time.monotonic()        # the store answered last; this watch ran last
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
                self.board.publish(self.progress, tick, self.doing)
                beats = self.board.read()
                reached = now
            except Exception:  # noqa: BLE001 - a store that does not answer is what is being judged
                beats = {}
            for rank, beat in beats.items():
                old = seen.get(rank)
                if old is None or beat.progress != old.progress:
                    progress_at[rank] = now
                if old is None or beat.tick != old.tick:
                    tick_at[rank] = now
                seen[rank] = beat
            if not started:               # judged once every rank has made its first step (a first step may
                started = len(seen) == self.info.world_size and all(b.progress > 0 for b in seen.values())
                continue                  # compile for minutes; dist.timeout_s bounds the start)
            latest = max(progress_at.values())
            if now - latest > self.timeout_s() or now - reached > self.timeout_s():
                self._hung(now - latest, seen, progress_at, tick_at, now, now - reached)
                return

    def _hung(self, idle_s: float, seen: dict[int, Beat], progress_at: dict, tick_at: dict, now: float,
              unreached_s: float) -> None:
        """Name the rank, dump this rank's stacks, record the exit and leave."""
        stale = {r: now - t for r, t in tick_at.items() if now - t > 3 * self.period_s}
        if unreached_s > self.timeout_s():
            named, why = 0, f"the rendezvous store (on rank 0's host) has not answered for {unreached_s:.0f} s"
        elif stale:
            named = max(stale, key=stale.get)
            why = f"its hang watch has been silent for {stale[named]:.0f} s (stopped, or stuck outside Python)"
        else:
            named = min(progress_at, key=progress_at.get)
            why = f"its progress is the oldest (last: {seen[named].doing})"
        cause = (f"hang: rank {named} made no progress, nor did any other rank, for {idle_s:.0f} s "
                 f"(train.hang_timeout_s={self.timeout_s():.0f}); {why}")
        where = self.run_dir / HANGS_DIR
        try:
            where.mkdir(parents=True, exist_ok=True)
            with open(where / f"rank-{self.info.rank}.txt", "w") as fh:
                fh.write(f"{cause}\nrank {self.info.rank} on {socket.gethostname()} pid {os.getpid()}, "
                         f"last: {self.doing}\nheartbeats: "
                         + ", ".join(f"rank {r}: {b.progress} ({b.doing})" for r, b in sorted(seen.items()))
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
        self.exit_fn(HANG)

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

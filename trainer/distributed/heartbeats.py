"""Each rank's heartbeat in the rendezvous store, read by every rank's hang watch (trainer/engine/components/
hang_watch.py): how far it got (progress: a count that also moves while a long phase lasts), where it is in the
schedule every rank follows in the same order (position: the engine's marks, equal on every rank at the same point),
and whether its watch still runs (a tick). A stopped rank's watch is stopped too: its tick is the oldest.

    board = HeartbeatBoard.connect(info, timeout_s=4.0)   # a client of its own: a short timeout, no collective
    board.publish(Beat(progress=12, tick=40, position=9, doing="step 3"))
    board.read()          # {rank: Beat(...), ...} of the ranks that have published; {} when unreachable

The store is the process group's (a TCPStore under srun, torchrun's agent store, Lightning's meeting store); a client
of its own keeps a watch thread from waiting on the main thread's calls, and its timeout bounds a read when the
store's host has stopped answering.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from trainer.distributed.runtime import DistInfo

PREFIX = "trainer/heartbeat"


def store_address() -> tuple[str, int] | None:
    """The host and port of the process group's TCPStore, where there is one."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return (host, int(port)) if host and port else None


@dataclass
class Beat:
    """One rank's heartbeat as read."""

    progress: int
    tick: int
    position: int
    doing: str

    def encode(self) -> str:
        return f"{self.progress}:{self.tick}:{self.position}:{self.doing}"

    @classmethod
    def parse(cls, raw: bytes) -> Beat | None:
        try:
            progress, tick, position, doing = raw.decode().split(":", 3)
            return cls(int(progress), int(tick), int(position), doing)
        except (ValueError, UnicodeDecodeError):
            return None


class HeartbeatBoard:
    """The ranks' heartbeats, on a store client of this process's watch alone."""

    def __init__(self, client, info: DistInfo, attempt: str = ""):
        self.client, self.info = client, info
        # torchrun's agent store outlives a restart of its workers: each attempt reads its own keys
        attempt = attempt or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.keys = [f"{PREFIX}/{attempt}/{r}" for r in range(info.world_size)]
        self.verdict_key, self.told_key = f"{PREFIX}/{attempt}/verdict", f"{PREFIX}/{attempt}/told"

    @classmethod
    def connect(cls, info: DistInfo, timeout_s: float) -> HeartbeatBoard | None:
        """A board on the process group's store; None where it has none this can reach (a world of one)."""
        where = store_address() if info.distributed and dist.is_initialized() else None
        if where is None:
            return None
        client = dist.TCPStore(where[0], where[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return cls(client, info)

    def publish(self, beat: Beat) -> None:
        self.client.set(self.keys[self.info.rank], beat.encode())

    def read(self) -> dict[int, Beat]:
        """The heartbeats published so far (a rank that has not published yet is left out)."""
        present = [r for r, key in enumerate(self.keys) if self.client.check([key])]
        values = self.client.multi_get([self.keys[r] for r in present]) if present else []
        return {r: beat for r, raw in zip(present, values) if (beat := Beat.parse(raw)) is not None}

    def post_verdict(self, cause: str) -> str:
        """The group's verdict: this one where none was posted before, else the one that was (the first wins)."""
        return self.client.compare_set(self.verdict_key, "", cause).decode()

    def verdict(self) -> str:
        """The verdict another rank posted, or ""."""
        return self.client.get(self.verdict_key).decode() if self.client.check([self.verdict_key]) else ""

    def told(self) -> int:
        """Count this rank as having recorded the verdict; how many have."""
        return self.client.add(self.told_key, 1)

    def how_many_told(self) -> int:
        return self.client.add(self.told_key, 0)

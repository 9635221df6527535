"""A process that uses the parsed-data cache the way a rank does, for the tests of many jobs sharing one cache:
it loads (or builds, or waits for) one entry, says how long that took, then holds its lease for a while.

    python -m tests.cache_user --root /tmp/c --data u.data --kcore 2 --hold 5          # the real SASRec parse
    python -m tests.cache_user --root /tmp/c --slow 20 --pid-file b.pid --child         # a slow builder

Prints one JSON line: {"seconds": time to the data, "built_s": the entry's build time, "entry": its name}.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np


def slow_build(seconds: float, pid_file: str, release: str = "") -> tuple[dict, dict]:
    """A builder that says its pid and takes `seconds` (in small sleeps, as a parse in Python would), and with
    `release` until that file exists too (a test that must see a waiter wait, whatever the machine's load); one that
    finds an earlier builder's pid file (a take-over) is quick, so that a test times the take-over alone."""
    if pid_file and Path(pid_file).exists():
        seconds = 0.0
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or (release and not Path(release).exists()):
        time.sleep(0.05)
    return dict(values=np.arange(10)), dict(built_by=os.getpid())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--data", help="a u.data file: the real SASRec parse (else the slow builder)")
    p.add_argument("--kcore", type=int, default=0)
    p.add_argument("--cap-gb", type=float, default=20.0)
    p.add_argument("--slow", type=float, default=5.0)
    p.add_argument("--pid-file", default="")
    p.add_argument("--release", default="", help="the build ends once this file exists (and --slow has passed)")
    p.add_argument("--child", action="store_true", help="build in a child process")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to keep the lease after loading")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    from trainer.data import cache
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("trainer.data.cache").addHandler(handler)
    from trainer.recipes.sasrec import data as D
    from trainer.recipes.sasrec.config import SeqDataConfig
    start = time.monotonic()
    try:
        if args.data:
            D.load(SeqDataConfig(path=args.data, cache=args.root, kcore=args.kcore, cache_cap_gb=args.cap_gb),
                   local_rank=args.local_rank)
            cache.evict_pending()                 # as the engine does once the run is not refused
            entry = next(Path(w).name for m in said for w in m.split() if w.startswith(args.root.rstrip("/") + "/"))
        else:
            key = dict(source="slow", seconds=args.slow)
            _, meta = cache.load_or_build(Path(args.root), "slow", key, "tests.cache_user:slow_build",
                                          (args.slow, args.pid_file, args.release), local_rank=args.local_rank,
                                          in_child=args.child)
            entry = cache.entry_name("slow", key)
    except Exception as err:                    # noqa: BLE001 - the test reads the line
        print(json.dumps(dict(error=f"{type(err).__name__}: {err}", seconds=time.monotonic() - start)), flush=True)
        return 3
    seconds = time.monotonic() - start
    manifest = json.loads((Path(args.root) / entry / "manifest.json").read_text())
    print(json.dumps(dict(seconds=round(seconds, 2), built_s=manifest["built_s"], entry=entry, done_at=time.time(),
                          node=os.environ.get("SLURMD_NODENAME"), built=any("parsing the data" in m for m in said))),
          flush=True)
    time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

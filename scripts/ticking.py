"""Run a command and say every 10 s that it still runs: `make setup`'s pip installs are silent for a minute or more
(pip -q), and a silent minute on a loaded login node gets a Ctrl-C. Standard library only: it runs before the
virtual environment exists.

    python3 scripts/ticking.py "installing torch==2.13.0 (pip)" -- .venv/bin/pip install -q torch==2.13.0
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

TICK_S = 10.0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python3 scripts/ticking.py LABEL -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    label, cmd = argv[0], argv[2:]
    t0 = time.monotonic()
    print(f"{label} ...", flush=True)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            print(f"{label}: {time.monotonic() - t0:.0f} s ...", flush=True)

    threading.Thread(target=tick, daemon=True).start()
    try:
        rc = subprocess.run(cmd).returncode
    except KeyboardInterrupt:
        return 130
    except OSError as err:
        print(f"{label}: cannot run {cmd[0]}: {err}", file=sys.stderr)
        return 127
    finally:
        done.set()
    print(f"{label}: {'done' if rc == 0 else f'failed (exit {rc})'} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

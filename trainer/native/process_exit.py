"""Ending a command's process without the interpreter's teardown.

    end_process(main())        # trainer/__main__.py and the `trainer` console script, never a library caller

A process that imported torch spends about a second after its last line tearing down modules and freeing the
objects of torch, sympy and dynamo one by one (measured on a 2-core node: 1.4 s of a 4.3 s toy run, every rank
of every launch, every requeue). Everything that must happen at exit is already registered with atexit (logging's
flush and close, multiprocessing's worker reaping, the data cache's leases) or done by the run itself (the
process group destroyed, checkpoints and TensorBoard closed): those run here, the standard streams are flushed,
and the process exits with its code. A thread that is not a daemon is still working: then Python's own shutdown
runs, which waits for it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def working_threads() -> list[str]:
    """Names of the live threads other than the main one that Python's shutdown would wait for."""
    main = threading.main_thread()
    return [t.name for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]


def end_process(code: int | None) -> NoReturn:
    """Exit with CODE after the atexit handlers and a flush of stdout and stderr, skipping module teardown."""
    code = 0 if code is None else code
    if working_threads():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed pipe or stream: nothing more can reach it anyway
            pass
    os._exit(code)

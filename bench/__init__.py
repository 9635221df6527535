"""Benchmarks: `python -m bench RECIPE ...` runs bench/run.py."""
import sys

from trainer.extras import missing_core

# every benchmark trains with torch: a Python without the project's environment (the system python3, .venv not
# activated) gets the interpreter to use instead of a traceback from deep inside the first import
try:
    import torch  # noqa: F401
except ModuleNotFoundError as err:
    if missing_core(err) is None:
        raise
    print(missing_core(err), file=sys.stderr)
    sys.exit(2)

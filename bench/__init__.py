"""Benchmarks: `python -m bench RECIPE ...` runs bench/run.py."""
from trainer.native.extras import exit_if_core_missing

# every benchmark trains with torch: a Python without the project's environment (the system python3, .venv not
# activated) gets the interpreter to use instead of a traceback from deep inside the first import
try:
    import torch  # noqa: F401
except ModuleNotFoundError as err:
    exit_if_core_missing(err)

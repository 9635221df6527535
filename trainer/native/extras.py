"""Optional dependencies: a recipe or tool that needs one says which extra installs it.

    av = require("av", extra="video", purpose="decoding and writing videos")
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

# the trainer's own dependencies (pyproject's `dependencies`) by import name: pip name
CORE = {"torch": "torch==2.13.0", "numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "psutil": "psutil",
        "PIL": "pillow"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the pip extra that installs it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """import module, or MissingExtraError naming `pip install 'hpc-trainer[extra]'`."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(
            f"{purpose} needs the Python package {module!r}, which is not installed ({err}).\n"
            f"HINT: pip install 'hpc-trainer[{extra}]' (or pip install -e '.[{extra}]' in the repository; "
            f"make setup installs every extra)") from None


def missing_core(err: ModuleNotFoundError) -> str | None:
    """The message for an entry point whose import failed on one of the trainer's own dependencies (a Python
    without the project's environment, e.g. the system python3 with .venv not activated); None for any other
    missing module (a real bug: let it raise)."""
    name = (err.name or "").split(".")[0]
    if name not in CORE:
        return None
    venv = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    hint = (f"HINT: this repository's environment is {venv}: run it with that interpreter "
            f"(or `source {venv.parent}/activate` first)" if venv.exists() and Path(sys.executable) != venv
            else "HINT: `make setup` in the repository (a .venv with everything), or pip install torch==2.13.0 "
                 "then pip install . (torch pinned first: an unpinned torch pulls several GB of CUDA wheels)")
    return f"error: {sys.executable} has no {name!r} module (the package {CORE[name]!r}).\n{hint}"


def exit_if_core_missing(err: ModuleNotFoundError) -> NoReturn:
    """In an entry point's `except ModuleNotFoundError`: exit 2 with missing_core's message, or re-raise."""
    message = missing_core(err)
    if message is None:
        raise err
    print(message, file=sys.stderr)
    sys.exit(2)

"""Optional dependencies: a recipe or tool that needs one says which extra installs it.

    av = require("av", extra="video", purpose="decoding and writing videos")
"""
from __future__ import annotations

import importlib
from types import ModuleType


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

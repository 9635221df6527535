"""Command-line entry: `python -m trainer COMMAND ...` parses and dispatches (trainer/cli/commands.py); one run's
assembly is trainer/engine/session.py.

    python -m trainer train --recipe toy --epochs 2 --run-dir runs/demo     # TRAINER_PLUGINS=tests.toy_recipe
    srun -N2 --ntasks-per-node=2 python -m trainer doctor
"""
from __future__ import annotations

import sys

from trainer.native.extras import exit_if_core_missing

try:
    from trainer.cli.commands import main
except ModuleNotFoundError as err:              # a Python without the project's environment: say which to use
    exit_if_core_missing(err)

if __name__ == "__main__":
    sys.exit(main())

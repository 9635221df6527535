"""Command-line entry: `python -m trainer COMMAND ...` hands the command line to trainer.cli.main (parse and dispatch:
trainer/cli/commands.py); one run's assembly is trainer/engine/session.py.

    python -m trainer train --recipe toy --epochs 2 --run-dir runs/demo     # TRAINER_PLUGINS=tests.toy_recipe
    srun -N2 --ntasks-per-node=2 python -m trainer doctor
"""
from trainer.cli import run

if __name__ == "__main__":
    run()

"""The command line: the parser (parser.py), the commands train, eval, doctor and data and their dispatch (commands.py),
`trainer doctor` (doctor.py) and `make demo` (demo.py). Its entry is main() below: the `trainer` console script,
`python -m trainer` (trainer/__main__.py, through run()) and the tests enter here.

    from trainer.cli import main
    main(["train", "--recipe", "toy", "--epochs", "2", "--run-dir", "runs/demo"])   # TRAINER_PLUGINS=tests.toy_recipe
"""
from __future__ import annotations

from typing import NoReturn

from trainer.native.extras import exit_if_core_missing


def main(argv: list[str] | None = None) -> int:
    """Parse argv (sys.argv[1:] when None), run the command, return its exit code; a Python without the project's
    environment (torch missing) exits 2 naming the one to use."""
    try:
        from trainer.cli.commands import main as run_command
    except ModuleNotFoundError as err:
        exit_if_core_missing(err)
    return run_command(argv)


def run() -> NoReturn:
    """The `trainer` console script and `python -m trainer`: main() on sys.argv, then the process ends without the
    interpreter's teardown (trainer/native/process_exit.py); a caller in a process of its own calls main()."""
    from trainer.native.process_exit import end_process
    end_process(main())

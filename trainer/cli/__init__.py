"""The command line: the parser (parser.py), the commands train, eval, doctor and data and their dispatch (commands.py),
`trainer doctor` (doctor.py) and `make demo` (demo.py). `python -m trainer` hands the command line to commands.main."""

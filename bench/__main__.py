"""`python -m bench [RECIPE ...] [--world 1 2] [--steps N]`: the benchmark harness (bench/run.py)."""
import sys

from bench.run import main

sys.exit(main())

"""Benchmarks: `python -m bench RECIPE ...` runs bench/run.py."""

"""Compatibility with the seed guides our users come from: their flags (flags.py: aliases of the same
meaning, or an error naming the replacement) and their scripts (scripts.py: main.py, main_multi_gpu.py,
train.py and the launch scripts at the repository root run the trainer with the guide's meaning)."""

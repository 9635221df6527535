"""The generic training engine: loop, checkpoints, preemption, logging, metrics."""

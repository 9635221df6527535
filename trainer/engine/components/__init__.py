"""A run's components (trainer/engine/callbacks.py Component), one concern per module, built once by the run's owner
(trainer/engine/trainer.py) and called by the loops: logging_window.py (the loss window's read, the signal agreement,
the train records), stragglers.py (the straggler watch), eviction.py, periodic.py (periodic checkpoints), limits.py
(train.max_steps), budget.py (torchrun's shutdown budget), progress.py (the progress bar), profiler.py
(log.profile), tracking.py (log.tracker: MLflow, W&B), search_trial.py (a search trial's reports and its pruner's
stop)."""

"""Where a run's data comes from, checked before anything starts: generated data on a cluster only when asked for.

    what = check_generated_data(cfg.data, "slurm")    # "data.path=DIR" | "generated data ..." | None; or ConfigError
"""
from __future__ import annotations

from typing import Any

from trainer.config.settings import ConfigError

CLUSTER_LAUNCHERS = ("slurm", "submitit")


def check_generated_data(data_cfg: Any, launcher: str) -> str | None:
    """Generated data on a cluster must be asked for: a run under Slurm or submitit whose data.path is empty stops at
    once unless data.synthetic=true (an sbatch script or `submit.py` without data.path would otherwise spend an
    allocation on made-up data). Returns what the run trains on, for the log and `submit.py --dry-run`; None for a
    recipe whose data section has no data.synthetic (one that only ever generates its data, as the tests' toy)."""
    if not hasattr(data_cfg, "path") or not hasattr(data_cfg, "synthetic"):
        return None
    synthetic = bool(data_cfg.synthetic)
    if data_cfg.path and synthetic:
        raise ConfigError(f"data.synthetic=true and data.path={data_cfg.path}: one or the other (data.synthetic=true "
                          f"trains on generated data, data.path on the files there)")
    if data_cfg.path:
        return f"data.path={data_cfg.path}"
    if launcher in CLUSTER_LAUNCHERS and not synthetic:
        raise ConfigError(f"data.path is empty: this {launcher} run would train on the recipe's generated data.\n"
                          f"HINT: set data.path=DIR (`python -m trainer data download --help` lists the datasets), "
                          f"or data.synthetic=true to train on generated data on purpose")
    return "generated data (data.path is empty)"

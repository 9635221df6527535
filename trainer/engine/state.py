"""Where training stands (TrainState: saved in every checkpoint, restored on resume), and how to say it.

    state = TrainState(epoch=2, batch_in_epoch=3, global_step=19)
    where(state)             # "epoch 2, batch 3"
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0
    batch_in_epoch: int = 0       # micro-batches this rank consumed in `epoch` (under `layout`)
    sample_in_epoch: int = 0      # samples of the epoch's permutation done, over all ranks (where a resume goes on)
    batches_in_epoch: int = 0     # micro-batches the epoch has under `layout` (a recipe's own plan: its length)
    layout: list[int] = field(default_factory=list)   # [world size, per-rank batch, accumulation] that wrote it
    global_step: int = 0          # optimizer steps
    best: float | None = None     # best value of the primary validation metric
    best_tie: float | None = None  # the recipe's tie-break metric at that evaluation
    bad_epochs: int = 0           # evaluations without improvement (early stopping)
    best_metric: str = ""         # the metric `best` is of ("": the recipe's, in checkpoints older than the setting)


def where(state: TrainState) -> str:
    """Where a checkpoint stands, in the evaluation lines' terms: "after epoch 3" at an epoch's end (state.epoch
    is then the next one, where a resume starts), else "epoch 4, batch 2"."""
    if state.batch_in_epoch == 0 and state.sample_in_epoch == 0 and state.epoch > 0:
        return f"after epoch {state.epoch - 1}"
    if state.batch_in_epoch == 0 and state.sample_in_epoch:      # a resume in another layout: its samples
        return f"epoch {state.epoch}, sample {state.sample_in_epoch}"
    return f"epoch {state.epoch}, batch {state.batch_in_epoch}"

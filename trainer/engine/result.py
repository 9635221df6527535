"""What a run reports to its caller (trainer/engine/session.py run_train), and how a stop a component asked for
turns into it (trainer/engine/callbacks.py Stop)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FitResult:
    """How a run ended: status completed | early_stopped | preempted | stopped (a component's Stop with an exit
    code: `code`, and its `reason` in words)."""

    status: str
    signal: int = 0
    requeued: bool = False
    global_step: int = 0
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    code: int | None = None       # the exit code a component's Stop asked for (None: the status decides)
    reason: str = ""              # why, in words (the exit record's cause)

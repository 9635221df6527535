"""Ranges of numeric config values: one rule, checked in one place (trainer.config.settings.set_key).

    @dataclass
    class ModelConfig:
        bounds: ClassVar[dict[str, Bound]] = dict(width=Bound(1), dropout=FRACTION)
        width: int = 64
        dropout: float = 0.1

A numeric field without an entry must be >= 0. Lists of numbers are checked item by item.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bound:
    """lo <= value <= hi (open ends exclude the limit); `zero` says what 0 means where it is special."""

    lo: float | None = 0
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    zero: str = ""

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        text = " and ".join(parts) or "a finite number"
        return f"{text} (0: {self.zero})" if self.zero else text

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return self.hi is None or (value < self.hi or (not self.hi_open and value == self.hi))


DEFAULT = Bound(0)
POSITIVE = Bound(1)                              # counts and sizes
FRACTION = Bound(0, 1, hi_open=True)             # dropout, label smoothing, held-out shares
CACHE_CAP = Bound(0, zero="no cap")               # data.cache_cap_gb


def bound_of(config: Any, name: str) -> Bound:
    """The declared bound of config.<name> (its class's `bounds`), else DEFAULT."""
    return getattr(type(config), "bounds", {}).get(name, DEFAULT)


def out_of_range(config: Any, name: str, value: Any) -> str | None:
    """Why value cannot be config.<name> ('must be >= 1'), or None when it can (non-numbers are not judged)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    bound = bound_of(config, name)
    if any(not bound.holds(v) for v in numbers):
        return f"must be {bound.describe()}" + (" for every item" if isinstance(value, (list, tuple)) else "")
    return None

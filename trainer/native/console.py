"""Progress bars on the console that are safe beside forked workers.

    bar = progress_bar(total=len(todo), desc="extract frames", unit="video")
"""
from __future__ import annotations

from typing import Any


def progress_bar(**kwargs: Any):
    """A tqdm bar without tqdm's monitor thread: DataLoader workers are forked, and a fork while another
    thread runs can leave the worker hung (seen once: a 2-rank video run whose worker never started after
    the frame-extraction bar had started the monitor)."""
    from tqdm.auto import tqdm
    tqdm.monitor_interval = 0
    return tqdm(**kwargs)

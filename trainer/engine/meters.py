"""What the loop measures of a run for the training log: system statistics and throughput."""
from __future__ import annotations

import time

import torch


class SystemStats:
    """CPU %, resident memory and peak GPU memory of this process."""

    def __init__(self):
        try:
            import psutil
            self._proc = psutil.Process()
            self._proc.cpu_percent(None)
        except ImportError:  # psutil is optional outside the pinned environments
            self._proc = None

    def snapshot(self, device: torch.device) -> dict[str, float]:
        """Current figures, named for metrics.jsonl."""
        out: dict[str, float] = {}
        if self._proc is not None:
            out["cpu_percent"] = round(self._proc.cpu_percent(None), 1)
            out["rss_mb"] = round(self._proc.memory_info().rss / 2**20, 1)
        if device.type == "cuda":
            out["gpu_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        return out


class Throughput:
    """Samples and optimizer steps per second over a logging window. On a CUDA device the window's time and
    its data wait come from CUDA events, read when the window is (after the window's one sync): the host runs
    ahead of the GPU, so its own clock would time the queueing of the kernels, not their work."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        self.reset()

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reset(self) -> None:
        """Start a new window."""
        self.t0, self.samples, self.steps, self.waited, self.synced = time.perf_counter(), 0, 0, 0.0, None
        self.phases: dict[str, float] = {}
        self.start_event = self._event() if self.cuda else None
        self.waits: list[tuple] = []       # CUDA: (event before, event after) each wait for a batch

    def timed(self, batches):
        """Yield from batches, adding the time spent waiting for each one (the loader) to the window. On CUDA,
        the time the GPU sat idle meanwhile: an event recorded before the wait and one after it complete
        together while the GPU still has queued work, and the wait apart when it has none."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            before = self._event() if self.cuda else None
            try:
                batch = next(it)
            except StopIteration:
                return
            if self.cuda:
                self.waits.append((before, self._event()))
            else:
                self.waited += time.perf_counter() - t0
            yield batch

    def update(self, samples: int, steps: int = 0, synced: float | None = None,
               phases: dict[str, float] | None = None) -> None:
        """Count samples (and optimizer steps) done since the window started, seconds spent waiting for
        gradients, and seconds per step phase (forward, backward: log.measure_sync)."""
        self.samples += samples
        self.steps += steps
        if synced is not None:
            self.synced = (self.synced or 0.0) + synced
        for name, seconds in (phases or {}).items():
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def _elapsed(self) -> float:
        """The window's seconds: the host clock, or on CUDA the GPU's from the window's first event to now."""
        if not self.cuda:
            return max(time.perf_counter() - self.t0, 1e-9)
        end = self._event()
        end.synchronize()
        self.waited = sum(a.elapsed_time(b) for a, b in self.waits) / 1000.0
        return max(self.start_event.elapsed_time(end) / 1000.0, 1e-9)

    def rates(self) -> dict[str, float]:
        """samples_per_s, step_time_s, data_wait_frac (share of the window spent waiting for batches) and,
        when measured, sync_wait_frac (waiting in collectives: gradients and the loop's own), forward_frac and
        backward_frac (the step's forward, its backward with DDP's collectives in it)."""
        dt = self._elapsed()
        out = dict(samples_per_s=self.samples / dt, step_time_s=dt / max(self.steps, 1),
                   data_wait_frac=round(min(self.waited / dt, 1.0), 4))
        if self.synced is not None:
            out["sync_wait_frac"] = round(min(self.synced / dt, 1.0), 4)
        out.update({f"{name}_frac": round(min(seconds / dt, 1.0), 4) for name, seconds in self.phases.items()})
        return out

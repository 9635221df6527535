"""glibc's allocator and large tensors; the free memory of this host (its cgroup's room) or GPU.

glibc maps every allocation above its mmap threshold (32 MiB at most) fresh from the kernel and unmaps it on
free, so a step that makes dozens of 47 MiB tensors (KGAT's propagation over amazon-book's 184k nodes) pays a
page fault for every 4 KiB page it touches, at every step: 370-535k faults per CF step, which took 1.8x as
long with two threads (1.13 vs 0.63 s) and 1.5x with one (2.01 vs 1.37 s); 1.1-1.2x at 1/8 of the size,
where the tensors are 6 MiB. With mmap off and the heap not trimmed, freed memory is reused: next to no
faults after the first step, at the cost of keeping the peak heap (peak RSS 2.26 -> 2.63 GiB there).
Smaller tensors fault too: glibc's dynamic threshold never settled in the video recipe's steps (19 MiB
activations), ~40k faults a step, 28% of its time in the kernel; with this, 1.5x the samples/s on one rank.
The engine applies it for every recipe (`Recipe.reuse_freed_memory`, True unless a recipe opts out).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4          # glibc's malloc.h
NEVER_TRIM = 2**31 - 1                         # mallopt takes an int: 2 GiB of free heap top before a trim


_process = {"keeps_freed": False}               # this process's malloc, once told (a process fact, not a rank's)


def reuse_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (no mmap, no trimming below 2 GiB). False, with
    nothing changed, off glibc or where the user tuned malloc already (MALLOC_* or GLIBC_TUNABLES set)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        log.info("malloc left as set in the environment (MALLOC_*/GLIBC_TUNABLES)")
        return False
    libc = ctypes.CDLL("libc.so.6")
    done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    _process["keeps_freed"] |= done
    return done


def keeps_freed_memory() -> bool:
    """Whether this process's malloc keeps what is freed (reuse_freed_memory ran): a large parse's temporaries
    would then stay resident, so the data cache builds in a child process instead."""
    return _process["keeps_freed"]


# ------------------------------------------------------------------ how much memory this host or device has free

def free_memory(info) -> tuple[int, str, int]:
    """(free bytes, where, how many ranks share them): a CUDA device's free memory, or the host's."""
    device = info.torch_device
    if device.type == "cuda":
        import torch  # only for a GPU's figure: the host's needs no torch
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device} ({torch.cuda.get_device_name(device)})", 1
    return host_available(), "available on this host", max(1, getattr(info, "local_world_size", 1))


def host_available() -> int:
    """MemAvailable, or less where this process's cgroup (a Slurm job's) has a memory limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = cgroup_room()
    candidates = [v for v in (avail, room) if v is not None]
    return min(candidates) if candidates else 2**62


def cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or limit - usage (v1); None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":                                   # v2: one unified hierarchy
            base = Path("/sys/fs/cgroup") / rel.lstrip("/")
            limit, used = base / "memory.max", base / "memory.current"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            limit, used = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            cap = limit.read_text().strip()
            if cap == "max" or int(cap) >= 2**60:
                return None
            return int(cap) - int(used.read_text().strip())
        except (OSError, ValueError):
            return None
    return None

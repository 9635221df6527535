"""CPU kernels in C++ (kernels.cpp: mHC's streams and maps, the hash-mask dropout), compiled on first use with
the system's C++ compiler and ninja, and cached; callers fall back to their PyTorch path where the kernels
cannot be built (one warning per process) or do not apply (GPU tensors, dtypes other than float32).

    ops = load()                 # the compiled module, or None (the cause in unavailable_reason())

The build is cached per source, torch version and CPU (the code is compiled with -march=native) under
$TRAINER_EXTENSIONS_DIR, else ~/.cache/hpc-trainer/extensions; each process builds in its own temporary
folder and moves the library into place, so a build killed half-way leaves no lock behind for the next run.
TRAINER_CPU_KERNELS=0 turns them off (no build, no warning).
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainer import native

SOURCE = Path(__file__).with_name("kernels.cpp")
NAME = "trainer_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]   # -fopenmp: at::parallel_for is inline
# OpenMP; -fno-math-errno: sqrt may vectorise (errno for a negative root kept it a scalar call)
_EXT = native.Extension(NAME, SOURCE, CFLAGS, ["-fopenmp"], what="fused CPU kernels",
                        fallback="the PyTorch path (same function, slower)", off_env="TRAINER_CPU_KERNELS")
build_key, load, unavailable_reason = _EXT.build_key, _EXT.load, _EXT.unavailable_reason
EXTENSION = _EXT


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors (CPU, float32)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

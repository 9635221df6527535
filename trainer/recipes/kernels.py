"""CPU kernels in C++, one module (cpu_kernels.cpp) from each owner's file: sasrec/mhc_kernels.h (mHC's streams and
maps), sasrec/attention_kernels.h (SASRec's attention), kgat/kgat_kernels.h (KGAT's edges and sparse Adam) and the
shared dropout_kernels.h and cpu_common.h; built by `make setup` (trainer.native) or on first use, and cached; callers
fall back to their PyTorch path where the kernels cannot be built (one warning per process) or do not apply (GPU
tensors, dtypes other than float32).

    ops = load()                 # the compiled module, or None (the cause in unavailable_reason())

The build is cached per source (its includes too), torch version and CPU (the code is compiled with -march=native) under
$TRAINER_EXTENSIONS_DIR, else ~/.cache/hpc-trainer/extensions; each process builds in its own temporary
folder and moves the library into place, so a build killed half-way leaves no lock behind for the next run.
TRAINER_CPU_KERNELS=0 turns them off (no build, no warning).
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainer.native import extensions as native

HERE = Path(__file__).parent
SOURCE = HERE / "cpu_kernels.cpp"
INCLUDES = (HERE / "cpu_common.h", HERE / "sasrec" / "mhc_kernels.h", HERE / "kgat" / "kgat_kernels.h",
            HERE / "dropout_kernels.h", HERE / "sasrec" / "attention_kernels.h")
NAME = "trainer_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]   # -fopenmp: at::parallel_for is inline
# OpenMP; -fno-math-errno: sqrt may vectorise (errno for a negative root kept it a scalar call)
_EXT = native.Extension(NAME, SOURCE, CFLAGS, ["-fopenmp"], what="fused CPU kernels",
                        fallback="the PyTorch path (same function, slower)", off_env="TRAINER_CPU_KERNELS",
                        depends=INCLUDES)
build_key, load, unavailable_reason = _EXT.build_key, _EXT.load, _EXT.unavailable_reason
EXTENSION = _EXT


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors (CPU, float32)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

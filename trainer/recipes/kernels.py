"""CPU kernels in C++, one module from each owner's fragment, found by name: every *_kernels.inc under trainer/recipes/
(today sasrec/mhc_kernels.inc: mHC's streams and maps, sasrec/attention_kernels.inc: SASRec's attention,
kgat/kgat_kernels.inc: KGAT's edges and sparse Adam, and the shared dropout_kernels.inc). A fragment is a part of the
one translation unit this module writes, not a header: it is included once, includes only the real header cpu_common.h
(inline helpers, the registry), never another fragment, and registers its own functions (TRAINER_KERNELS), so a recipe
adds kernels by adding a fragment to its folder. Built by `make kernels` (python -m trainer.native build) or behind
the first run that needs them (trainer/native/background.py), and cached; callers fall back to their PyTorch path
where the kernels cannot be built (one warning per process) or do not apply (GPU tensors, dtypes other than float32).

    ops = load()                 # the compiled module, or None (the cause in unavailable_reason())

The build is cached per module source (every header and fragment under trainer/recipes/ too), torch version and CPU
(the code is compiled with -march=native) under $TRAINER_EXTENSIONS_DIR, else ~/.cache/hpc-trainer/extensions; each
process builds in its own temporary folder and moves the library into place, so a build killed half-way leaves no lock
behind for the next run. TRAINER_CPU_KERNELS=0 turns them off (no build, no warning).
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainer.native import extensions as native

ROOT = Path(__file__).parent                # the one include root: includes are paths from here
NAME = "trainer_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]   # -fopenmp: at::parallel_for is inline
# OpenMP; -fno-math-errno: sqrt may vectorise (errno for a negative root kept it a scalar call)


FRAGMENT = "*_kernels.inc"


def kernel_fragments(root: Path = ROOT) -> list[Path]:
    """Every recipe's kernels: the *_kernels.inc fragments under trainer/recipes/, each registering its own
    functions."""
    return sorted(root.rglob(FRAGMENT))


def module_source(fragments: list[Path], root: Path = ROOT) -> str:
    """The module: one translation unit including each fragment once; its init calls what they registered."""
    includes = "".join(f'#include "{h.relative_to(root).as_posix()}"\n' for h in fragments)
    return ("// Written by trainer/recipes/kernels.py: the kernel fragments under trainer/recipes/.\n" + includes +
            "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { trainer_cpu::register_all(m); }\n")


_EXT = native.Extension(NAME, None, CFLAGS, ["-fopenmp"], what="fused CPU kernels",
                        fallback="the PyTorch path (same function, slower)", off_env="TRAINER_CPU_KERNELS",
                        depends=lambda: sorted([*ROOT.rglob("*.h"), *ROOT.rglob("*.inc")]), include_dirs=(ROOT,),
                        generate=lambda: module_source(kernel_fragments()))
build_key, load, unavailable_reason = _EXT.build_key, _EXT.load, _EXT.unavailable_reason
EXTENSION = _EXT


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors (CPU, float32)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

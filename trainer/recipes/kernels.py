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

import hashlib
import importlib.util
import os
import platform
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.cpp")
NAME = "trainer_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]          # -fopenmp: at::parallel_for is inline OpenMP
_state: dict = {}


def cache_root() -> Path:
    return Path(os.environ.get("TRAINER_EXTENSIONS_DIR") or Path.home() / ".cache" / "hpc-trainer" / "extensions")


def build_key() -> str:
    """What a cached build depends on: the source, torch, the compiler flags and this CPU (-march=native)."""
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    parts = [SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode(), cpu.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(target: Path):
    from torch.utils.cpp_extension import load
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        module = load(NAME, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                      verbose=False)
        os.replace(module.__file__, target)         # atomic: a concurrent build's result is the same library
        return module
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load():
    """The compiled module, or None (once per process: a failed build is not retried, and warned about once)."""
    if "ops" not in _state:
        _state["ops"], _state["why"] = None, ""
        if os.environ.get("TRAINER_CPU_KERNELS", "1") == "0":
            _state["why"] = "TRAINER_CPU_KERNELS=0"
            return None
        target = cache_root() / build_key() / f"{NAME}.so"
        try:
            _state["ops"] = _import(target) if target.exists() else _build(target)
        except Exception as e:           # noqa: BLE001 - any build failure means the PyTorch path
            _state["why"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"fused CPU kernels unavailable ({_state['why']}); using the PyTorch path (same "
                          "function, slower). TRAINER_CPU_KERNELS=0 silences this.", stacklevel=2)
    return _state["ops"]


def unavailable_reason() -> str:
    return _state.get("why", "")

"""C++ extensions compiled on first use with the system's C++ compiler and ninja, and cached; callers fall back
to a PyTorch path where one cannot be built (one warning per process).

    ext = Extension("trainer_cpu_kernels", Path("kernels.cpp"), ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"],
                    what="fused CPU kernels", fallback="the PyTorch path (same function, slower)",
                    off_env="TRAINER_CPU_KERNELS")
    ops = ext.load()             # the compiled module, or None (the cause in ext.unavailable_reason())

A build is cached per source, torch version, flags and CPU (-march=native) under $TRAINER_EXTENSIONS_DIR, else
~/.cache/hpc-trainer/extensions; each process builds in its own temporary folder and moves the library into place,
so a build killed half-way leaves no lock behind for the next run. `<off_env>=0` turns one off (no build, no
warning).
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


def cache_root() -> Path:
    return Path(os.environ.get("TRAINER_EXTENSIONS_DIR") or Path.home() / ".cache" / "hpc-trainer" / "extensions")


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


class Extension:
    """One C++ source built into one Python module, once per process."""

    def __init__(self, name: str, source: Path, cflags: list[str], ldflags: list[str], what: str, fallback: str,
                 off_env: str):
        self.name, self.source, self.cflags, self.ldflags = name, source, cflags, ldflags
        self.what, self.fallback, self.off_env = what, fallback, off_env
        self._ops, self._why, self._tried = None, "", False

    def build_key(self) -> str:
        """What a cached build depends on: the source, torch, the compiler flags and this CPU (-march=native)."""
        parts = [self.source.read_bytes(), torch.__version__.encode(), " ".join(self.cflags).encode(),
                 _cpu_flags().encode()]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]

    def target(self) -> Path:
        return cache_root() / self.build_key() / f"{self.name}.so"

    def _import(self, path: Path):
        spec = importlib.util.spec_from_file_location(self.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _build(self, target: Path):
        from torch.utils.cpp_extension import load
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
        try:
            module = load(self.name, [str(self.source)], extra_cflags=self.cflags, extra_ldflags=self.ldflags,
                          build_directory=str(tmp), verbose=False)
            os.replace(module.__file__, target)         # atomic: a concurrent build's result is the same library
            return module
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self):
        """The compiled module, or None (once per process: a failed build is not retried, and warned about once)."""
        if self._tried:
            return self._ops
        self._tried = True
        if os.environ.get(self.off_env, "1") == "0":
            self._why = f"{self.off_env}=0"
            return None
        target = self.target()
        try:
            self._ops = self._import(target) if target.exists() else self._build(target)
        except Exception as e:           # noqa: BLE001 - any build failure means the fallback
            self._why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"{self.what} unavailable ({self._why}); using {self.fallback}. {self.off_env}=0 "
                          "silences this.", stacklevel=3)
        return self._ops

    def unavailable_reason(self) -> str:
        return self._why

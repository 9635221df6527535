"""C++ extensions compiled with the system's C++ compiler and ninja, and cached; callers fall back to a PyTorch
path where one cannot be built (one warning per process).

    ext = Extension("trainer_shm_allreduce", Path("shm.cpp"), ["-O3", "-march=native"], [],
                    what="the shared-memory all-reduce", fallback="gloo's", off_env="TRAINER_SHM_KERNEL")
    ops = ext.load()             # the compiled module, or None (the cause in ext.unavailable_reason())
    python -m trainer.native build [--portable]     # `make kernels`; else a run builds them behind itself

Two targets: `native` (-march=native, cached per CPU type) and `portable` (-march=x86-64-v3, where the CPU has it: one
build that compute nodes of other CPU types with AVX2 reuse, for images and shared home directories). A process loads
the native build of its CPU type if there is one, else a portable build its CPU can run, else goes on with the
fallback and has the native one built behind it (trainer/native/background.py; TRAINER_NATIVE_BUILD=wait builds it in
the process, saying so first, with the last build's time here). Builds are cached under $TRAINER_EXTENSIONS_DIR, else
~/.cache/hpc-trainer/extensions; each process builds in its own temporary folder and moves the library into place, so
a build killed half-way leaves no lock behind for the next run. `<off_env>=0` turns one off.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from trainer.native import background


def cache_root() -> Path:
    return Path(os.environ.get("TRAINER_EXTENSIONS_DIR") or Path.home() / ".cache" / "hpc-trainer" / "extensions")


PORTABLE_ARCH = "x86-64-v3"
# what -march=x86-64-v3 may use: a CPU without one of these cannot run the portable build
V3_FLAGS = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm", "sse4_2", "ssse3", "popcnt"}
EXTENSIONS: list["Extension"] = []          # every extension of the package, for `python -m trainer.native build`
# the modules that declare them
EXTENSION_MODULES = ("trainer.distributed.shm", "trainer.recipes.kernels", "trainer.data.kernels")


def runs_portable() -> bool:
    """Whether this CPU can run the portable (x86-64-v3) build."""
    flags = set(_cpu_flags().split())
    return platform.machine() in ("x86_64", "AMD64") and V3_FLAGS <= flags


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


class Extension:
    """One C++ source built into one Python module, once per process. The source is a file, or text that
    `generate()` writes (a module made of the headers found at build time: trainer/recipes/kernels.py), compiled
    with `include_dirs` on the include path."""

    def __init__(self, name: str, source: Path | None, cflags: list[str], ldflags: list[str], what: str,
                 fallback: str, off_env: str, depends: tuple[Path, ...] = (), generate: Callable[[], str] | None = None,
                 include_dirs: tuple[Path, ...] = ()):
        self.name, self.source, self.cflags, self.ldflags = name, source, cflags, ldflags
        self.generate, self.include_dirs = generate, tuple(include_dirs)
        self._depends = depends                 # the files `source` includes (or a function finding them)
        self.what, self.fallback, self.off_env = what, fallback, off_env
        self._ops, self._why, self._tried = None, "", False
        EXTENSIONS.append(self)

    @property
    def depends(self) -> tuple[Path, ...]:
        """The files the source includes: a change of one rebuilds too."""
        return tuple(self._depends() if callable(self._depends) else self._depends)

    def source_text(self) -> bytes:
        return self.generate().encode() if self.generate is not None else self.source.read_bytes()

    def flags_for(self, portable: bool) -> list[str]:
        if not portable:
            return self.cflags
        return [f"-march={PORTABLE_ARCH}" if f == "-march=native" else f for f in self.cflags]

    def build_key(self, portable: bool = False) -> str:
        """What a cached build depends on: the source, torch, the compiler flags and, for the native target,
        this CPU type."""
        parts = [self.source_text(), *(d.read_bytes() for d in self.depends), torch.__version__.encode(),
                 " ".join(self.flags_for(portable)).encode(),
                 PORTABLE_ARCH.encode() if portable else _cpu_flags().encode()]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]

    def target(self, portable: bool = False) -> Path:
        return cache_root() / self.build_key(portable) / f"{self.name}.so"

    def cached(self) -> Path | None:
        """The build this process can load without compiling: native for this CPU type, else portable."""
        native = self.target()          # each target hashes the sources: once each
        if native.exists():
            return native
        portable = self.target(portable=True) if runs_portable() else None
        return portable if portable is not None and portable.exists() else None

    def _import(self, path: Path):
        spec = importlib.util.spec_from_file_location(self.name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def build(self, portable: bool = False):
        """Compile (announced on stderr with the last build's time here, if any, then its elapsed time every TICK_S)
        and cache; returns the module."""
        from torch.utils.cpp_extension import load
        target = self.target(portable)
        kind = f"portable ({PORTABLE_ARCH})" if portable else "native"
        key = f"{self.name}-{'portable' if portable else 'native'}"
        took = background.last_build_s(cache_root(), [key])
        when = f": the last build here took {took:.0f} s" if took else ""
        print(f"building {self.what} ({kind}), once per CPU type{when}; cached in {target.parent}",
              file=sys.stderr, flush=True)
        t0 = time.monotonic()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
        done = threading.Event()
        threading.Thread(target=_tick, args=(done, f"building {self.what} ({kind})", t0), daemon=True).start()
        try:
            source = self.source
            if self.generate is not None:
                source = tmp / f"{self.name}.cpp"
                source.write_text(self.generate())
            module = load(self.name, [str(source)], extra_cflags=self.flags_for(portable),
                          extra_include_paths=[str(d) for d in self.include_dirs], extra_ldflags=self.ldflags,
                          build_directory=str(tmp), verbose=False)
            os.replace(module.__file__, target)         # atomic: a concurrent build's result is the same library
        finally:
            done.set()
            shutil.rmtree(tmp, ignore_errors=True)
        background.record_build(cache_root(), key, time.monotonic() - t0)
        print(f"built {self.what} ({kind}) in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return module

    def load(self):
        """The compiled module, or None (once per process: a failed build is not retried, and warned about once)."""
        if self._tried:
            return self._ops
        self._tried = True
        if os.environ.get(self.off_env, "1") == "0":
            self._why = f"{self.off_env}=0"
            return None
        found = self.cached()
        try:
            if found is None and (how := background.build_mode()) != "wait":
                self._why = self._not_built(how)
                return None
            self._ops = self._import(found) if found is not None else self.build()
        except Exception as e:           # noqa: BLE001 - any build failure means the fallback
            self._why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"{self.what} unavailable ({self._why}); using {self.fallback}. {self.off_env}=0 "
                          "silences this.", stacklevel=3)
        return self._ops

    def _not_built(self, how: str) -> str:
        """No build for this CPU type: the run goes on at once on the fallback, saying so in one line, and (the
        default) a builder starts behind it unless one runs or the last build of these sources failed."""
        failed = background.last_failure(self.target().parent)
        if failed is not None:
            why = f"its last build failed ({failed.splitlines()[-1][:200]}; log {cache_root() / background.LOG})"
            hint = "`python -m trainer.native build` retries"
        elif how == "off":
            why, hint = f"not built for this CPU type ({background.MODE_ENV}=off)", "`make kernels` builds it"
        else:
            why = f"not built for this CPU type yet: {background.start_or_join(self.name, cache_root())}"
            hint = "runs after it use it; `make kernels` builds ahead"
        print(f"{self.what}: {why}; this run uses {self.fallback}; {hint}; {self.off_env}=0 silences this",
              file=sys.stderr, flush=True)
        return why

    def unavailable_reason(self) -> str:
        return self._why


TICK_S = 10.0


def _tick(done: threading.Event, what: str, t0: float) -> None:
    """A line every TICK_S while a build runs: a silent minute looks like a hang (and gets a Ctrl-C)."""
    while not done.wait(TICK_S):
        print(f"{what}: {time.monotonic() - t0:.0f} s ...", file=sys.stderr, flush=True)


def build_cache_dir(cache: Path) -> Path:
    """Where in a build cache that outlives one cache_root (an image build's cache mount) this machine's builds go:
    a build key covers sources, torch and flags; a folder per compiler version and Python ABI covers the rest."""
    import sysconfig
    try:
        compiler = subprocess.run([os.environ.get("CXX", "c++"), "-dumpfullversion"], capture_output=True, text=True,
                                  timeout=30).stdout.strip() or "unknown"
    except OSError:
        compiler = "none"
    return cache / f"cxx{compiler}-{sysconfig.get_config_var('SOABI') or 'py'}"


def _kept(ext: Extension, portable: bool, cache: Path) -> Path:
    return cache / ext.build_key(portable) / f"{ext.name}.so"


def _copy_whole(src: Path, dst: Path) -> None:
    """A library copied so that no reader ever sees half of it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".so.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def from_cache(ext: Extension, portable: bool, cache: Path | None) -> bool:
    """Copy ext's build for this target out of the build cache into cache_root(); False where it has none."""
    if cache is None or not (kept := _kept(ext, portable, cache)).exists():
        return False
    _copy_whole(kept, ext.target(portable))
    print(f"{ext.what} ({'portable' if portable else 'native'}): from the build cache ({kept})")
    return True


def to_cache(ext: Extension, portable: bool, cache: Path | None) -> None:
    if cache is not None:
        _copy_whole(ext.target(portable), _kept(ext, portable, cache))


def build_all(portable: bool, only_portable: bool = False, strict: bool = False, cache: Path | None = None,
              behind: str | None = None) -> int:
    """`python -m trainer.native build [--portable]`: every extension for this CPU type (and, with --portable and a
    CPU that runs it, the portable target too); an existing build is kept. Exit 0 even without a compiler: the
    trainer then uses its PyTorch paths, and says so. The builds run side by side, one per core (each is one
    compiler process: one after the other, a 2-core image build took 31 + 85 + 28 s; side by side about 85).
    cache (--cache): a build cache that outlives cache_root (the Dockerfile's cache mount): a build found there is
    copied, not compiled (an image rebuilt for a change to the Python alone compiles nothing); one compiled is
    kept there. behind (--background NAME, what a run starts: trainer/native/background.py): niced, one build at a
    time, NAME's first, a failure recorded for the runs to read, the builders' lock released at the end."""
    try:
        return _build_all(portable, only_portable, strict, cache, behind)
    finally:
        if behind is not None:
            background.release(cache_root())


def yield_cores() -> None:
    """The builder behind a run gives the cores to the run first: nice 10, and the same for its session's autogroup
    (the builder runs in a session of its own, and with autogroups, Linux's default, a nice value only weighs within
    a session: measured here, a niced compiler in its own session still took a whole core from a 2-rank run)."""
    os.nice(10)
    try:
        Path("/proc/self/autogroup").write_text("10")
    except OSError:
        pass                                                # no autogroups (or not Linux): nice alone holds


def _build_all(portable: bool, only_portable: bool, strict: bool, cache: Path | None, behind: str | None) -> int:
    from concurrent.futures import ThreadPoolExecutor
    for module in EXTENSION_MODULES:                        # each declares its extension when imported
        importlib.import_module(module)
    if behind is not None:
        yield_cores()
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: building behind a run (pid {os.getpid()})", flush=True)
    cache = build_cache_dir(cache) if cache is not None else None
    todo = []
    for ext in EXTENSIONS:
        targets = (True,) if only_portable else (False, True) if portable and runs_portable() else (False,)
        for port in targets:
            if ext.target(port).exists():
                print(f"{ext.what} ({'portable' if port else 'native'}): built already ({ext.target(port)})")
            elif behind is not None and background.last_failure(ext.target(port).parent) is not None:
                continue                                    # a run does not retry a failed build: the foreground does
            elif not from_cache(ext, port, cache):
                todo.append((ext, port))
    todo.sort(key=lambda job: job[0].name != behind)        # stable: the one the run needs first, then the rest

    def build(job: tuple[Extension, bool]) -> bool:
        ext, port = job
        background.clear_failure(ext.target(port).parent)
        try:
            ext.build(port)
            to_cache(ext, port, cache)
            return True
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja: the fallback works, say it once
            why = "\n  ".join(str(e).strip().splitlines()[-8:])
            print(f"{ext.what}: cannot build ({type(e).__name__}: {why}); the trainer will use {ext.fallback}",
                  file=sys.stderr, flush=True)
            if behind is not None:
                background.record_failure(ext.target(port).parent, f"{type(e).__name__}: {why}")
            return False

    workers = 1 if behind is not None else max(1, min(len(todo), len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        failed = not all(list(pool.map(build, todo)))     # list: all() would stop at a failure, cancelling the rest
    return 1 if strict and failed else 0

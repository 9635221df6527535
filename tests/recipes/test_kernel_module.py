"""The CPU kernels' module (trainer/recipes/kernels.py): one translation unit made of every *_kernels.inc fragment
under trainer/recipes/, each standing alone on the one real header (cpu_common.h) and registering its own functions, so
a recipe adds kernels without editing a shared file; built once per CPU type (or portable), cached by every file it
depends on."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.timeouts import limit
from trainer.native import extensions as native
from trainer.recipes import kernels


def test_a_portable_build_serves_a_cpu_type_without_its_own(ops, tmp_path, monkeypatch):
    """A shared cache holding only the portable (x86-64-v3) build: a CPU that runs it loads it, no compiler run
    (the library copied in stands for one built on another node)."""
    if not native.runs_portable():
        pytest.skip(f"this CPU lacks {native.PORTABLE_ARCH}'s instructions: the portable build cannot serve it")
    native_build = native.cache_root() / kernels.build_key() / f"{kernels.NAME}.so"
    monkeypatch.setenv("TRAINER_EXTENSIONS_DIR", str(tmp_path))
    real = kernels.EXTENSION
    ext = native.Extension(kernels.NAME, None, kernels.CFLAGS, ["-fopenmp"], what="fused CPU kernels", fallback="-",
                           off_env="TRAINER_CPU_KERNELS", depends=real.depends, include_dirs=real.include_dirs,
                           generate=real.generate)
    native.EXTENSIONS.remove(ext)
    assert ext.cached() is None
    portable = ext.target(portable=True)
    assert portable != ext.target() and "-march=x86-64-v3" in ext.flags_for(True)
    portable.parent.mkdir(parents=True)
    portable.write_bytes(native_build.read_bytes())
    assert ext.cached() == portable
    monkeypatch.setattr(ext, "build", lambda portable=False: pytest.fail("compiled although a build was there"))
    assert ext.load() is not None


def test_build_is_cached_per_source_and_moved_into_place(ops):
    target = native.cache_root() / kernels.build_key() / f"{kernels.NAME}.so"
    assert target.is_file()
    assert not [p for p in target.parent.iterdir() if p.name.startswith("build-")]   # no half-built leftovers
    assert os.access(target, os.R_OK)


def test_every_header_registers_its_own_functions_in_the_module(ops):
    """The module holds what each owner's header registered: mHC's, SASRec's attention, KGAT's and the shared
    dropout, with no list of them anywhere else."""
    headers = kernels.kernel_fragments()
    assert {h.parent.name for h in headers} >= {"sasrec", "kgat", "recipes"}
    for header in headers:
        text = header.read_text()
        assert "TRAINER_KERNELS(" in text, header
        for name in [line.split('"')[1] for line in text.splitlines() if line.strip().startswith('m.def("')]:
            assert hasattr(ops, name), f"{header.name} registers {name}, which the module lacks"
    assert {"maps_in", "attention", "gather_dot", "dropout"} <= set(dir(ops))


def test_fragments_include_only_headers_and_the_header_defines_only_inline_functions():
    """A fragment is included once, into the module's one translation unit: it includes no other fragment (no
    include order to get right) and is not named a header; cpu_common.h, included by every fragment, is a real
    header (#pragma once; no non-inline function, which a second translation unit would define twice)."""
    import re
    for fragment in kernels.kernel_fragments():
        includes = re.findall(r'#include "([^"]+)"', fragment.read_text())
        assert includes == ["cpu_common.h"], (fragment.name, includes)
    assert not list(kernels.ROOT.rglob("*_kernels.h"))
    common = (kernels.ROOT / "cpu_common.h").read_text()
    assert "#pragma once" in common
    lines = common.splitlines()
    defined = [(lines[i - 1], line) for i, line in enumerate(lines)
               if re.match(r"^\w[\w:<>, ]*\s\w+\([^;]*\)\s*{", line)]   # a function defined at the namespace's level
    plain = [line for before, line in defined if not (line.startswith("inline ") or before.startswith("template"))]
    assert len(defined) >= 5 and plain == [], plain


def test_a_new_recipes_header_joins_the_module_and_any_header_change_rebuilds(tmp_path):
    """Adding a recipe's kernels is adding a header to its folder: it is found and included, and the build key
    covers it, as it covers every header the module depends on."""
    for header in kernels.kernel_fragments():
        assert f'#include "{header.relative_to(kernels.ROOT).as_posix()}"' in kernels.module_source(
            kernels.kernel_fragments())
    root = tmp_path / "recipes"
    (root / "newrec").mkdir(parents=True)
    shutil.copy(kernels.ROOT / "cpu_common.h", root)
    (root / "newrec" / "newrec_kernels.inc").write_text("// one\n")
    (root / "newrec" / "helpers.h").write_text("// not a kernel header: included by one\n")
    found = kernels.kernel_fragments(root)
    assert found == [root / "newrec" / "newrec_kernels.inc"]
    assert '#include "newrec/newrec_kernels.inc"' in kernels.module_source(found, root)
    ext = native.Extension("probe", None, ["-O1"], [], what="probe", fallback="-", off_env="PROBE",
                           depends=lambda: sorted(root.rglob("*.h")),
                           generate=lambda: kernels.module_source(kernels.kernel_fragments(root), root))
    native.EXTENSIONS.remove(ext)
    before = ext.build_key()
    (root / "newrec" / "helpers.h").write_text("// two\n")
    assert ext.build_key() != before
    (root / "other").mkdir()
    (root / "other" / "other_kernels.inc").write_text("// a second recipe\n")
    assert '#include "other/other_kernels.inc"' in ext.generate()


def _compiler_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths
    return ["-std=c++20", *kernels.CFLAGS, "-DTORCH_EXTENSION_NAME=probe", *(f"-I{p}" for p in include_paths()),
            f"-I{sysconfig.get_paths()['include']}"]         # the module's own flags, as torch's build passes them


@pytest.mark.long        # a minute of compiling: make test-fast leaves it out
def test_each_fragment_compiles_on_its_own(tmp_path):
    """Each header is a translation unit of its own: its own includes (paths from the one root kernels.py states)
    and its own namespace, so no include order matters. To keep this cheap, cpu_common.h (the first include of
    every kernel header, and torch's headers with it) is checked once and kept as a precompiled header; each
    kernel header is then checked from a folder of its own, where only that precompiled form of cpu_common.h is
    found."""
    if shutil.which("g++") is None:
        print("SKIP: no g++ on PATH: the headers cannot be compiled here", file=sys.stderr)
        pytest.skip("no g++ on PATH: the headers cannot be compiled here")
    flags, pch = _compiler_flags(), tmp_path / "pch"
    pch.mkdir()
    common = subprocess.run(["g++", *flags, "-x", "c++-header", str(kernels.ROOT / "cpu_common.h"), "-o",
                             str(pch / "cpu_common.h.gch")], capture_output=True, text=True, timeout=limit("jobs"))
    assert common.returncode == 0, common.stderr[-3000:]

    def check(header: Path) -> tuple[Path, subprocess.CompletedProcess]:
        inside = header.relative_to(kernels.ROOT) if kernels.ROOT in header.parents else header.relative_to(tmp_path)
        alone = tmp_path / "alone" / inside
        alone.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(header, alone)
        return header, subprocess.run(["g++", *flags, "-Winvalid-pch", f"-I{pch}", f"-I{kernels.ROOT}", "-fsyntax-only",
                                       "-x", "c++", str(alone)], capture_output=True, text=True, timeout=limit("jobs"))

    headers = kernels.kernel_fragments()
    assert len(headers) >= 4
    example = (REPO / "docs/extending.md").read_text().split("## A recipe's own C++ kernels")[1].split("```cpp\n")[1]
    documented = tmp_path / "docs" / "tinyreg" / "tinyreg_kernels.inc"     # the page's example, checked the same way
    documented.parent.mkdir(parents=True)
    documented.write_text(example.split("```")[0])
    headers.append(documented)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for header, proc in pool.map(check, headers):
            assert proc.returncode == 0, f"{header} does not compile on its own:\n{proc.stderr[-3000:]}"

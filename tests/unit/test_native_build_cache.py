"""`python -m trainer.native build --cache DIR` (the Dockerfile's cache mount): a build found in the cache is copied
into $TRAINER_EXTENSIONS_DIR instead of compiled, one compiled is kept there, and the cache is split by compiler and
Python ABI, which a build key does not cover. The real image build is make test-image's (tests/container)."""
from __future__ import annotations

import sysconfig

import pytest

from trainer.native import extensions as native


@pytest.fixture
def probe(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_EXTENSIONS_DIR", str(tmp_path / "image"))
    text = {"source": "// one\n"}
    ext = native.Extension("probe", None, ["-O1"], [], what="the probe", fallback="-", off_env="PROBE",
                           generate=lambda: text["source"])
    native.EXTENSIONS.remove(ext)              # not one of the trainer's: build_all must not build it
    return ext, text


def test_a_build_kept_in_the_cache_is_copied_not_compiled(tmp_path, probe, capsys):
    ext, _ = probe
    cache = tmp_path / "cache"
    assert not native.from_cache(ext, True, cache)                    # nothing there yet: it must be compiled
    ext.target(True).parent.mkdir(parents=True)
    ext.target(True).write_bytes(b"compiled library")               # what ext.build(True) leaves
    native.to_cache(ext, True, cache)
    ext.target(True).unlink()                                         # the next image build's fresh layer
    assert native.from_cache(ext, True, cache)
    assert ext.target(True).read_bytes() == b"compiled library"
    assert "the probe (portable): from the build cache" in capsys.readouterr().out


def test_a_changed_source_misses_the_cache(tmp_path, probe):
    ext, text = probe
    cache = tmp_path / "cache"
    ext.target(True).parent.mkdir(parents=True)
    ext.target(True).write_bytes(b"old library")
    native.to_cache(ext, True, cache)
    text["source"] = "// two\n"                                      # a header edited: another build key
    assert not native.from_cache(ext, True, cache) and not ext.target(True).exists()


def test_the_cache_has_a_folder_per_compiler_and_python_abi(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.build_cache_dir(tmp_path) == tmp_path / f"cxxnone-{sysconfig.get_config_var('SOABI')}"
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho 12.2.0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert native.build_cache_dir(tmp_path).name.startswith("cxx12.2.0-")

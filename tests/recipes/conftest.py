"""Fixtures shared by the recipes' kernel tests."""
import pytest

from trainer.recipes import kernels


@pytest.fixture(scope="module")
def ops():
    """The compiled CPU kernels; the test is skipped, with the reason printed, where they cannot be built
    (test_mhc_fused.py has its own, stricter one: a toolchain that is here must build them)."""
    module = kernels.load()
    if module is None:
        print(f"SKIP: CPU kernels not built here: {kernels.unavailable_reason()}")
        pytest.skip(f"CPU kernels not built here: {kernels.unavailable_reason()}")
    return module

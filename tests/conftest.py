"""Shared pytest set-up: the CPU kernel ISA builds this machine can run, the hypothesis
profile (fixed examples under CI, so a CI run never fails on an example no developer saw), and
the `cuda` marker on every test that needs a GPU (`pytest -m cuda` runs just those)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import fusedamp
from fusedamp import _C

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

ALL_CPU_ISAS = ("avx512", "avx2", "baseline")


def _supported(isa: str) -> bool:
    previous = _C.cpu_isa()
    try:
        _C.set_cpu_isa(isa)
    except ValueError:
        return False
    _C.set_cpu_isa(previous)
    return True


SUPPORTED_CPU_ISAS = tuple(isa for isa in ALL_CPU_ISAS if _supported(isa))

# For tests that compare a vector build with the baseline (scalar) kernels, which a native build
# on an AVX2 or AVX-512 CPU leaves out (FUSEDAMP_CPU_ISAS=all builds them, as CI does).
needs_baseline_kernels = pytest.mark.skipif(
    "baseline" not in SUPPORTED_CPU_ISAS,
    reason="no baseline kernels here (FUSEDAMP_CPU_ISAS=all builds them)",
)

# For tests that run fusedamp's CUDA kernels (import it: `from conftest import needs_cuda`).
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and fusedamp.build_info()["cuda_compiled"]),
    reason="needs a GPU and fusedamp's CUDA kernels",
)


@pytest.fixture(params=ALL_CPU_ISAS)
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per CPU kernel build (AVX-512, AVX2, baseline) that this build has
    (FUSEDAMP_CPU_ISAS=all builds all three) and this CPU supports."""
    isa = request.param
    if isa not in SUPPORTED_CPU_ISAS:
        pytest.skip(f"no {isa} kernels here (not built, or this CPU cannot run them)")
    previous = _C.set_cpu_isa(isa)
    yield isa
    _C.set_cpu_isa(previous)


def _needs_gpu(item: pytest.Item) -> bool:
    """A test needs a GPU when it is skipped without one ("needs a ... GPU ...") or takes a
    "cuda" device parameter."""
    for mark in item.iter_markers("skipif"):
        reason = mark.kwargs.get("reason", "")
        if reason.startswith("needs a") and "GPU" in reason:
            return True
    params = item.callspec.params.values() if hasattr(item, "callspec") else ()
    return any(isinstance(value, str) and value == "cuda" for value in params)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_gpu(item):
            item.add_marker(pytest.mark.cuda)

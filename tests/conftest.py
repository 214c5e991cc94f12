"""Shared pytest set-up: the CPU kernel ISA builds this machine can run, and the hypothesis
profile (fixed examples under CI, so a CI run never fails on an example no developer saw)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

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


@pytest.fixture(params=ALL_CPU_ISAS)
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per CPU kernel build (AVX-512, AVX2, baseline) this CPU supports."""
    isa = request.param
    if isa not in SUPPORTED_CPU_ISAS:
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    previous = _C.set_cpu_isa(isa)
    yield isa
    _C.set_cpu_isa(previous)

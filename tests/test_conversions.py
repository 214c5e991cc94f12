"""Exhaustive checks of the kernels' fp16/bf16 <-> fp32 conversions (math/dtypes.h) against torch."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_baseline_kernels

from fusedamp import _C, ops

HALF_DTYPES = [torch.float16, torch.bfloat16]
# 1.0 round-trips every value; the others land between representable values and exercise
# round-to-nearest-even, subnormals, overflow to inf and underflow to zero.
INV_SCALES = [1.0, 1.0 + 2.0**-12, 0.7, 3.3e-3, 2.0**-20, 1000.0]


def every_bit_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("inv_scale", INV_SCALES)
def test_every_half_value_unscales_like_torch(cpu_isa: str, dtype: torch.dtype, inv_scale: float) -> None:
    values = every_bit_pattern(dtype)
    expected = (values.float() * torch.tensor(inv_scale, dtype=torch.float32)).to(dtype)
    grads = [values.clone()]
    found_inf = torch.zeros(())
    ops.unscale_(grads, found_inf, torch.tensor(inv_scale))
    nan = expected.isnan()
    assert torch.equal(grads[0].isnan(), nan)
    assert torch.equal(grads[0][~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert found_inf.item() == 1.0  # the patterns include inf and NaN


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_random_floats_round_like_torch(cpu_isa: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=generator, dtype=torch.int64)
    floats = bits.to(torch.int32).view(torch.float32)
    floats = floats[floats.isfinite()]
    # Unscaling half h by (float / h) lands on arbitrary floats between representable half
    # values, so this checks the kernel's float -> half rounding on random inputs.
    halves = floats.to(dtype)
    finite = halves.isfinite() & (halves != 0)
    halves, floats = halves[finite], floats[finite]
    ratio = (floats / halves.float()).clamp(0.5, 2.0)
    for inv in ratio[:16].tolist():
        expected = (halves.float() * torch.tensor(inv)).to(dtype)
        grads = [halves.clone()]
        ops.unscale_(grads, torch.zeros(()), torch.tensor(inv))
        assert torch.equal(grads[0].view(torch.int16), expected.view(torch.int16))


@needs_baseline_kernels
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("inv_scale", [1.0, 0.7, 2.0**-20])
def test_isa_builds_agree_bitwise_nan_payloads_included(cpu_isa: str, dtype: torch.dtype, inv_scale: float):
    """The vector conversions of the AVX2 / AVX-512 builds ([note: half staging]) against the
    scalar rule of math/dtypes.h that the baseline build runs, on every bit pattern: NaNs keep
    their payload and gain the quiet bit in both."""
    values = every_bit_pattern(dtype)
    results = {}
    previous = _C.set_cpu_isa("baseline")
    try:
        for isa in ("baseline", cpu_isa):
            _C.set_cpu_isa(isa)
            grads = [values.clone()]
            ops.unscale_(grads, torch.zeros(()), torch.tensor(inv_scale))
            results[isa] = grads[0].view(torch.int16)
    finally:
        _C.set_cpu_isa(previous)
    assert torch.equal(results["baseline"], results[cpu_isa])

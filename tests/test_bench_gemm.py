"""bench_gemm's check of a kernel's result before it is timed (run on CPU tensors: the check is
plain torch): a result within rounding of torch's passes, a wrong one is named and not timed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_gemm import result_error


@pytest.fixture
def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 1024, generator=g)
    w = torch.randn(80, 1024, generator=g)
    return x, w, torch.randn(80, generator=g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_a_result_rounded_once_from_fp32_passes(operands, dtype, activation):
    x, w, bias = operands
    exact = F.linear(x.to(dtype).double(), w.to(dtype).double(), bias.to(dtype).double())
    # What fusedamp computes: the epilogue in fp32, rounded once; torch rounds before its GELU.
    ours = (F.gelu(exact) if activation == "gelu" else exact).to(dtype)
    theirs = F.linear(x.to(dtype), w.to(dtype), bias.to(dtype))
    theirs = F.gelu(theirs) if activation == "gelu" else theirs
    assert result_error(ours, theirs) == ""


def test_wrong_results_are_named(operands):
    x, w, bias = operands
    reference = F.linear(x, w, bias).to(torch.bfloat16)
    assert result_error(reference.clone(), reference) == ""
    skipped_tile = reference.clone()
    skipped_tile[:64, :64] = 0
    # All 4096 zeroed elements but those of torch's within the tolerance of 0.
    assert "4094 of 7680 elements off" in result_error(skipped_tile, reference)
    without_bias = F.linear(x, w).to(torch.bfloat16)
    assert "elements off" in result_error(without_bias, reference)
    poisoned = reference.clone()
    poisoned[5, 7] = float("nan")
    assert "non-finite" in result_error(poisoned, reference)
    assert "shape (96, 79)" in result_error(reference[:, :79], reference)

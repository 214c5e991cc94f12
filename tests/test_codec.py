"""The 8-bit state codec (csrc/include/fusedamp/math/codec.h, [note: block codes]) against a float64
reference of its definition, on every CPU ISA build: blocks of 256 elements in storage order, a
partial last block, signed and unsigned codes, zeros, non-finite values and flushing."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import needs_baseline_kernels

import fusedamp.ops as ops
from fusedamp import _C

BLOCK = 256


def reference(values: torch.Tensor, signed: bool) -> torch.Tensor:
    """What decode(encode(values)) must give, computed in float64 from the definition: each
    block's scale is 2^e with e the exponent of its largest finite magnitude rounded to 3 mantissa
    bits; a value keeps 3 mantissa bits (nearest, ties up) if it lies in the 2^4 (signed) or 2^5
    (unsigned) binades at and below 2^e, else flushes to 0 (signed) or to the smallest code."""
    flat = values.flatten().double()
    out = torch.empty_like(flat)
    binades = 15 if signed else 31
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start : start + BLOCK]
        finite = block.abs().nan_to_num(nan=0.0, posinf=0.0)
        top_value = _round3(finite.max().item())
        for i, x in enumerate(block.tolist()):
            if math.isnan(x) or math.isinf(x):
                out[start + i] = x if signed or math.isnan(x) else abs(x)
                continue
            magnitude = _round3(abs(x))
            top = math.frexp(top_value)[1] if top_value > 0 else None
            if top is None or magnitude == 0 or math.frexp(magnitude)[1] <= top - binades:
                kept = 0.0 if signed or x == 0 else 2.0 ** (top - binades) if top is not None else 0.0
            else:
                kept = magnitude
            out[start + i] = math.copysign(kept, x) if signed else kept
    return out.view(values.shape).float()


def _round3(x: float) -> float:
    if x == 0:
        return 0.0
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return math.floor(mantissa * 16 + 0.5) / 16 * 2.0**exponent  # nearest, ties away from zero


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4097])
def test_codes_decode_to_the_float64_reference(cpu_isa: str, signed: bool, numel: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4
    values = values if signed else values.square()
    codes, scales = ops.encode_state(values, signed)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape
    assert scales.shape == ((numel + BLOCK - 1) // BLOCK,)
    decoded = ops.decode_state(codes, scales, signed)
    torch.testing.assert_close(decoded, reference(values, signed), rtol=0, atol=0)
    # Within the binades a block keeps, each value is off by at most half a unit of 3 bits.
    binades = 15 if signed else 31
    per_element = scales.repeat_interleave(BLOCK)[:numel]
    in_range = values.abs() >= per_element * 2.0 ** (2 - binades)
    relative = ((decoded - values).abs() / values.abs())[in_range]
    assert relative.max() <= 2**-4


@pytest.mark.parametrize("signed", [True, False])
def test_special_values_zero_and_flushing(cpu_isa: str, signed: bool) -> None:
    values = torch.tensor([1.0, 0.0, -0.0, float("nan"), float("inf"), 1e-6, 3e-5, 2.0**-20, 0.5])
    if not signed:
        values = values.abs()
    codes, scales = ops.encode_state(values, signed)
    decoded = ops.decode_state(codes, scales, signed)
    torch.testing.assert_close(decoded, reference(values, signed), rtol=0, atol=0, equal_nan=True)
    assert decoded[3].isnan() and decoded[4] == float("inf")
    if signed:
        assert decoded[5] == 0  # below the 16 binades under the block's largest value: flushed
    else:
        assert decoded[5] > 0  # a nonzero second moment never decodes as 0


def test_all_zero_and_huge_blocks() -> None:
    for values in (torch.zeros(300), torch.full((300,), 3.0e38), torch.full((10,), 1e-40)):
        codes, scales = ops.encode_state(values, True)
        decoded = ops.decode_state(codes, scales, True)
        assert decoded.isfinite().all()
        assert ((decoded - values).abs() <= values.abs() * 2**-4 + 1e-38).all()


def test_reencoding_decoded_codes_is_the_identity(cpu_isa: str) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(3000, generator=generator) * 10 ** torch.randint(-6, 3, (3000,), generator=generator)
    for signed in (True, False):
        source = values if signed else values.abs()
        codes, scales = ops.encode_state(source, signed)
        again, again_scales = ops.encode_state(ops.decode_state(codes, scales, signed), signed)
        assert torch.equal(again, codes) and torch.equal(again_scales, scales)


def test_codes_follow_storage_order_in_any_memory_format() -> None:
    values = torch.randn(2, 3, 17, 11).to(memory_format=torch.channels_last)
    codes, scales = ops.encode_state(values, True)
    assert codes.stride() == values.stride()
    flat_codes, flat_scales = ops.encode_state(values.permute(0, 2, 3, 1).flatten(), True)
    assert torch.equal(codes.permute(0, 2, 3, 1).flatten(), flat_codes) and torch.equal(scales, flat_scales)
    torch.testing.assert_close(ops.decode_state(codes, scales, True), reference(values, True), rtol=0, atol=0)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match="values must be float32"):
        ops.encode_state(torch.zeros(3, dtype=torch.float16), True)
    codes, scales = ops.encode_state(torch.zeros(300), True)
    with pytest.raises(RuntimeError, match="one scale per 256 codes"):
        ops.decode_state(codes, scales[:1], True)


def _every_bit_pattern(low_bits_seed: int) -> torch.Tensor:
    """Every fp32 sign/exponent/high-mantissa pattern (the top 16 bits), with random low bits:
    normals, subnormals, zeros, infinities and NaNs, in blocks of neighbouring magnitudes."""
    generator = torch.Generator().manual_seed(low_bits_seed)
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.randint(0, 1 << 16, (1 << 16,), generator=generator)
    return (high | low).to(torch.int32).view(torch.float32)


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
def test_vector_codes_equal_the_element_codes_for_every_bit_pattern(cpu_isa: str, signed: bool) -> None:
    """The AVX-512 and AVX2 builds encode a vector at a time ([note: vector codes]); their codes
    and decoded values must be the element functions' (the baseline build) bit for bit, in
    blocks whose largest value sits anywhere in fp32's range (so both the normal-block and the
    general vector forms run), with shuffled blocks (specials among ordinary values) too."""
    patterns = _every_bit_pattern(1)
    shuffled = patterns[torch.randperm(patterns.numel(), generator=torch.Generator().manual_seed(2))]
    blocks = (patterns, shuffled, patterns[:1000] * 2.0**-100, shuffled[:999] * 2.0**-120)
    # An unsigned state also meets values with the sign bit set (a -0, a NaN, a state dict's negative
    # value): their blocks take the slower forms, with the same codes.
    for values in blocks if signed else [block.abs() for block in blocks] + list(blocks):
        codes, scales = ops.encode_state(values, signed)
        decoded = ops.decode_state(codes, scales, signed)
        previous = _C.set_cpu_isa("baseline")
        try:
            expected_codes, expected_scales = ops.encode_state(values, signed)
            expected_decoded = ops.decode_state(codes, scales, signed)
        finally:
            _C.set_cpu_isa(previous)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
        assert torch.equal(decoded.view(torch.int32), expected_decoded.view(torch.int32))


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
def test_every_code_decodes_as_the_element_function_on_every_build(cpu_isa: str, signed: bool) -> None:
    """Powers of two from the top exponent where the vector decoders add to the exponent
    ([note: normal decode]) down to just below it, and scales that are no power of two (a state
    dict may hold any float), which take the multiply."""
    top = 15 if signed else 31
    powers = [2.0**127, 1.0, 2.0**-60, 2.0 ** (top - 127), 2.0 ** (top - 128), 2.0**-126, 2.0**-140]
    others = [3.0, 0.7, -2.0, -0.0, 0.0, float("inf"), float("nan"), 1.5 * 2.0**-120]
    scales = torch.tensor(powers + others)
    codes = torch.arange(256, dtype=torch.uint8).repeat(scales.numel())
    decoded = ops.decode_state(codes, scales, signed)
    previous = _C.set_cpu_isa("baseline")
    try:
        expected = ops.decode_state(codes, scales, signed)
    finally:
        _C.set_cpu_isa(previous)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [256, 300, 4097])
def test_blocks_with_and_without_special_codes_decode_as_the_element_function(
    cpu_isa: str, signed: bool, numel: int
) -> None:
    """The vector decoders scan a block once for codes of E = 0 (zero, NaN, inf) and skip the
    per-vector check when it has none (block_decode_of): blocks of ordinary codes only, and with
    one special code anywhere (a block's first and last element, a partial block's tail), must
    decode as the element function does."""
    generator = torch.Generator().manual_seed(numel)
    magnitudes = torch.randint(8, 128 if signed else 256, (numel,), generator=generator)
    signs = torch.randint(0, 2, (numel,), generator=generator) * 0x80 if signed else 0
    ordinary = (magnitudes | signs).to(torch.uint8)
    blocks = (numel + BLOCK - 1) // BLOCK
    scales = torch.tensor([1.0, 2.0**-60]).repeat(blocks)[:blocks]
    specials = [0, 1, 2, 0x80, 0x81, 0x82] if signed else [0, 1, 2, 7]
    cases = [ordinary]
    for position in sorted({0, 63, 64, 255, numel - 1, numel - 2}):
        for special in specials:
            codes = ordinary.clone()
            codes[position] = special
            cases.append(codes)
    decoded = [ops.decode_state(codes, scales, signed) for codes in cases]
    previous = _C.set_cpu_isa("baseline")
    try:
        expected = [ops.decode_state(codes, scales, signed) for codes in cases]
    finally:
        _C.set_cpu_isa(previous)
    for got, want in zip(decoded, expected, strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isfinite(decoded[0]).all() and (decoded[0] != 0).all()

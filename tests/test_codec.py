"""The 8-bit state codec (csrc/include/fusedamp/math/codec.h, [note: block codes]) against a float64
reference of its definition, on every CPU ISA build: the code values of each form, blocks of 256
elements in storage order with their scale and form, a partial last block, signed and unsigned
codes, zeros, non-finite values and the values below the smallest code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import needs_baseline_kernels

import fusedamp.ops as ops
from fusedamp import _C

BLOCK = 256
# (top code, offset, shift) of each form: signed narrow and wide, unsigned ([note: block codes]).
FORMS = {"narrow": (0x7F, 0, 1), "wide": (0x7F, 0, 2), "unsigned": (0xFF, 32, 3)}
WIDE_BINADES = 4
SPECIALS = 3  # codes 0, 1, 2: zero, NaN, inf


def form_values(form: str) -> dict[int, float]:
    """The relative value of each value code of `form`, from the definition: the integer n = c +
    offset = 2^p (1 + m) read as a float whose `shift` top mantissa bits join the exponent is
    2^(2^shift p + floor(2^shift m)) (1 + frac(2^shift m)); scaled so the top code is in [0.5, 1)."""
    top, offset, shift = FORMS[form]
    raw = {}
    for code in range(SPECIALS, top + 1):
        n = code + offset
        power = n.bit_length() - 1
        if power < shift:  # fewer bits under the leading one than the shift takes: no value
            continue
        moved = (n / 2**power - 1) * 2**shift
        raw[code] = 2.0 ** (2**shift * power + math.floor(moved)) * (1 + moved - math.floor(moved))
    unit = 2.0 ** (math.frexp(raw[top])[1])
    return {code: value / unit for code, value in raw.items()}


VALUES = {form: form_values(form) for form in FORMS}


def test_code_values_follow_the_definition_and_taper() -> None:
    for form, signed in (("narrow", True), ("wide", True), ("unsigned", False)):
        values = VALUES[form]
        codes = torch.tensor(sorted(values), dtype=torch.uint8)
        stored = torch.tensor([1.0]).bfloat16()
        if form == "wide":
            stored = (stored.view(torch.int16) | -0x8000).view(torch.bfloat16)
        decoded = ops.decode_state(codes, stored, signed)
        assert decoded.tolist() == [values[code] for code in sorted(values)], form
        ordered = list(values.values())
        assert all(a < b for a, b in zip(ordered, ordered[1:], strict=False)), form
        # The precision tapers: the top binade has the finest steps (5 bits narrow and unsigned,
        # 4 wide), and the range spans 11 (narrow), 20 (wide) or 24 (unsigned) binades.
        top_step = ordered[-1] - ordered[-2]
        assert top_step == 2.0 ** (-6 if form != "wide" else -5), form
        assert round(math.log2(ordered[-1] / ordered[0])) == {"narrow": 11, "wide": 20, "unsigned": 24}[form]


def _float32(x: float) -> float:
    return float(np.float32(x))


def _bf16_ceil(x: float) -> float:
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    return float(np.array(min((bits + 0xFFFF) >> 16, 0x7F7F) << 16, dtype=np.uint32).view(np.float32))


def reference_block(block: list[float], signed: bool) -> tuple[float, bool, list[tuple[int, ...]]]:
    """A block's scale (a float), form and, for each value, the codes encoding may give: the
    nearest code (ties up), or either neighbour when the value is within 2^-12 of a code step
    from the midpoint (the encoder's float add rounds there)."""
    finite = [abs(x) for x in block if math.isfinite(x)]
    largest = max(finite, default=0.0)
    exponents = [int(np.array(abs(x), dtype=np.float32).view(np.uint32)) >> 23 for x in block]
    top_exponent = int(np.array(largest, dtype=np.float32).view(np.uint32)) >> 23
    wide = signed and len(block) * top_exponent > sum(exponents) + WIDE_BINADES * len(block)
    form = ("wide" if wide else "narrow") if signed else "unsigned"
    values = VALUES[form]
    codes = sorted(values)
    if largest < 2.0**-126:
        return 0.0, wide, [(0,) if signed or x == 0 else (codes[0],) for x in block]
    scale = _bf16_ceil(_float32(_float32(largest) / _float32(values[codes[-1]])))
    inverse = _float32(1.0 / scale)
    choices = []
    for x in block:
        if math.isnan(x):
            choices.append((1,))
            continue
        sign = 0x80 if signed and math.copysign(1, x) < 0 else 0
        if math.isinf(x):
            choices.append((2 | sign,))
            continue
        relative = _float32(_float32(abs(x)) * inverse)
        ladder = [(0.0, 0)] + [(values[c], c) for c in codes] if signed else [(values[c], c) for c in codes]
        if not signed and relative < values[codes[0]]:
            choices.append((0,) if x == 0 else (codes[0],))
            continue
        below = max((v, c) for v, c in ladder if v <= relative)
        above = min(((v, c) for v, c in ladder if v > relative), default=below)
        position = 0.0 if above == below else (relative - below[0]) / (above[0] - below[0])
        nearest = above[1] if position >= 0.5 else below[1]
        options = {nearest, above[1], below[1]} if abs(position - 0.5) < 2**-12 else {nearest}
        choices.append(tuple(sorted(code | sign for code in options)))
    return scale, wide, choices


def check_against_reference(values: torch.Tensor, signed: bool) -> None:
    codes, scales = ops.encode_state(values, signed)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == ((values.numel() + BLOCK - 1) // BLOCK,)
    flat, flat_codes = values.flatten().tolist(), codes.flatten().tolist()
    for b, stored in enumerate(scales.view(torch.int16).tolist()):
        block = flat[b * BLOCK : (b + 1) * BLOCK]
        scale, wide, choices = reference_block(block, signed)
        assert (stored < 0) == wide, b
        assert float(torch.tensor(stored & 0x7FFF, dtype=torch.int16).view(torch.bfloat16)) == scale, b
        for i, options in enumerate(choices):
            assert flat_codes[b * BLOCK + i] in options, (b, i, block[i], options, flat_codes[b * BLOCK + i])


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000, 4097])
def test_codes_are_the_nearest_of_the_reference(cpu_isa: str, signed: bool, numel: int) -> None:
    generator = torch.Generator().manual_seed(numel)
    gaussian = torch.randn(numel, generator=generator)
    heavy = gaussian * torch.exp(2 * torch.randn(numel, generator=generator))  # wide blocks
    for values in (gaussian, heavy):
        check_against_reference(values if signed else values.square(), signed)


@pytest.mark.parametrize("signed", [True, False])
def test_decoded_values_keep_the_forms_precision(cpu_isa: str, signed: bool) -> None:
    # Within the top binades a value is off by at most half a code step: 2^-6 (narrow, unsigned)
    # or 2^-5 (wide) of its block's scale, relative 2^-6 or 2^-5 at the top binade's floor.
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(100_000, generator=generator)
    values = values if signed else values.square()
    codes, scales = ops.encode_state(values, signed)
    decoded = ops.decode_state(codes, scales, signed)
    per_element = scales.float().abs().repeat_interleave(BLOCK)[: values.numel()]
    top_binade = values.abs() >= 0.5 * per_element
    assert ((decoded - values).abs() <= per_element * 2**-7 * 1.001)[top_binade].all()


@pytest.mark.parametrize("signed", [True, False])
def test_special_values_zero_and_the_smallest_codes(cpu_isa: str, signed: bool) -> None:
    specials = torch.tensor([1.0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), 0.5])
    # A narrow block (its values near its largest) with three values below its smallest code.
    small = torch.tensor([1.0] * 20 + [1e-4, 3e-4, 1e-9])
    for values in (specials, small):
        values = values if signed else values.abs()
        check_against_reference(values, signed)
    decoded = ops.decode_state(*ops.encode_state(specials, signed), signed)
    assert decoded[3].isnan() and decoded[4] == float("inf") and decoded[1] == 0
    assert decoded[5] == (-float("inf") if signed else float("inf"))
    assert math.copysign(1, decoded[2]) == (-1 if signed else 1)  # -0 keeps its sign
    codes, scales = ops.encode_state(small, signed)
    decoded = ops.decode_state(codes, scales, signed)
    if signed:
        # Below the narrow form's smallest code (2^-11 of the scale): the nearest of 0 and it.
        smallest = VALUES["narrow"][3] * float(scales.float()[0])
        assert decoded[20] == 0 and decoded[21] == smallest and decoded[22] == 0
    else:
        assert decoded[22] > 0  # a nonzero second moment never decodes as 0


def test_all_zero_tiny_and_huge_blocks() -> None:
    blocks = (torch.zeros(300), torch.full((300,), 3.0e38), torch.full((10,), 1e-40), torch.full((5,), 2e-38))
    for values in blocks:
        for signed in (True, False):
            codes, scales = ops.encode_state(values, signed)
            decoded = ops.decode_state(codes, scales, signed)
            assert decoded.isfinite().all()
            if values[0] >= 2.0**-126:
                assert ((decoded - values).abs() <= values.abs() * 2**-6).all()
            else:
                assert (decoded == 0).all() and (scales.float() == 0).all()


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


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match="values must be float32"):
        ops.encode_state(torch.zeros(3, dtype=torch.float16), True)
    codes, scales = ops.encode_state(torch.zeros(300), True)
    with pytest.raises(RuntimeError, match="one scale per 256 codes"):
        ops.decode_state(codes, scales[:1], True)
    with pytest.raises(TypeError, match="scales bfloat16"):
        ops.decode_state(codes, scales.float(), True)


def _every_bit_pattern(low_bits_seed: int) -> torch.Tensor:
    """Every fp32 sign/exponent/high-mantissa pattern (the top 16 bits), with random low bits:
    normals, subnormals, zeros, infinities and NaNs, in blocks of neighbouring magnitudes."""
    generator = torch.Generator().manual_seed(low_bits_seed)
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.randint(0, 1 << 16, (1 << 16,), generator=generator)
    return (high | low).to(torch.int32).view(torch.float32)


def _baseline(function, *args):  # noqa: ANN001, ANN202
    previous = _C.set_cpu_isa("baseline")
    try:
        return function(*args)
    finally:
        _C.set_cpu_isa(previous)


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
def test_vector_codes_equal_the_element_codes_for_every_bit_pattern(cpu_isa: str, signed: bool) -> None:
    """The AVX-512 and AVX2 builds encode a vector at a time ([note: vector codes]); their codes
    and decoded values must be the element functions' (the baseline build) bit for bit, in
    blocks whose largest value sits anywhere in fp32's range, in both forms, with shuffled blocks
    (specials among ordinary values) too."""
    patterns = _every_bit_pattern(1)
    shuffled = patterns[torch.randperm(patterns.numel(), generator=torch.Generator().manual_seed(2))]
    gaussian = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    blocks = (patterns, shuffled, patterns[:1000] * 2.0**-100, shuffled[:999] * 2.0**-120, gaussian)
    # An unsigned state also meets values with the sign bit set (a -0, a NaN, a state dict's negative
    # value): their blocks take the slower forms, with the same codes.
    for values in blocks if signed else [block.abs() for block in blocks] + list(blocks):
        codes, scales = ops.encode_state(values, signed)
        decoded = ops.decode_state(codes, scales, signed)
        expected_codes, expected_scales = _baseline(ops.encode_state, values, signed)
        expected_decoded = _baseline(ops.decode_state, codes, scales, signed)
        assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
        assert torch.equal(decoded.view(torch.int32), expected_decoded.view(torch.int32))


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
def test_values_beyond_the_largest_scales_reach_take_the_top_code(cpu_isa: str, signed: bool) -> None:
    """The vector encoders clamp nothing in a block whose largest value sits at most at the top
    code (BlockScale's plain blocks). Under the largest bf16 scale, values above about 3.37e38
    lie beyond the top code: their block must take the clamping encoder, and give the element
    functions' codes, the largest value the top code."""
    values = torch.linspace(1.0e38, 3.4e38, 600)
    if signed:
        values[::3] *= -1
    codes, scales = ops.encode_state(values, signed)
    expected_codes, expected_scales = _baseline(ops.encode_state, values, signed)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)
    top = 0x7F if signed else 0xFF
    assert int(codes[-1]) & top == top
    decoded = ops.decode_state(codes, scales, signed)
    assert decoded.isfinite().all() and (decoded.sign() == values.sign()).all()


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
def test_every_code_decodes_as_the_element_function_on_every_build(cpu_isa: str, signed: bool) -> None:
    """Every code under scales across bf16's range, with and without the wide form's flag, and
    the zero scale of a block without a normal value."""
    scales = torch.tensor([2.0**127, 1.0, 2.0**-60, 3.0, 0.7, 1.5 * 2.0**-120, 2.0**-126, 0.0]).bfloat16()
    flagged = (scales.view(torch.int16) | -0x8000).view(torch.bfloat16)
    scales = torch.cat([scales, flagged])
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(scales.numel())
    decoded = ops.decode_state(codes, scales, signed)
    expected = _baseline(ops.decode_state, codes, scales, signed)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))


@needs_baseline_kernels
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [256, 300, 4097])
def test_blocks_with_and_without_special_codes_decode_as_the_element_function(
    cpu_isa: str, signed: bool, numel: int
) -> None:
    """The vector decoders scan a block once for the codes of zero, NaN and inf and skip the
    per-vector check when it has none (block_decode_of): blocks of value codes only, and with
    one special code anywhere (a block's first and last element, a partial block's tail), must
    decode as the element function does."""
    generator = torch.Generator().manual_seed(numel)
    magnitudes = torch.randint(4, 128 if signed else 256, (numel,), generator=generator)
    signs = torch.randint(0, 2, (numel,), generator=generator) * 0x80 if signed else 0
    ordinary = (magnitudes | signs).to(torch.uint8)
    blocks = (numel + BLOCK - 1) // BLOCK
    scales = torch.tensor([1.0, -(2.0**-60)]).repeat(blocks)[:blocks].bfloat16()
    specials = [0, 1, 2, 3, 0x80, 0x81, 0x82] if signed else [0, 1, 2, 3]
    cases = [ordinary]
    for position in sorted({0, 63, 64, 255, numel - 1, numel - 2}):
        for special in specials:
            codes = ordinary.clone()
            codes[position] = special
            cases.append(codes)
    decoded = [ops.decode_state(codes, scales, signed) for codes in cases]
    expected = [_baseline(ops.decode_state, codes, scales, signed) for codes in cases]
    for got, want in zip(decoded, expected, strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isfinite(decoded[0]).all() and (decoded[0] != 0).all()

"""How an optimizer's per-element states are stored ([note: state codecs] in csrc/registration.cpp):
float32, bfloat16, or 8-bit block codes with one bfloat16 scale per 256 elements (csrc/include/
fusedamp/math/codec.h, [note: block codes]), and the conversions between them and float32.

A moment ``key`` of an ``"int8"`` state is a uint8 tensor of codes in the param's memory format,
with its scales under ``key + "_scales"`` (1-D bfloat16, one per block of 256 elements in storage
order; the sign bit of a signed state's scale says which form its block's codes take, so a scale
may read as negative). The optimizer steps store bf16 and int8 states rounded stochastically
([note: unbiased state rounding] in codec.h); the conversions here round to nearest.

Earlier builds of fusedamp stored other 8-bit codes (3 mantissa bits under a power-of-two float32 scale);
a state of that format, recognised by its float32 scales, is decoded exactly and encoded again
when it is loaded (:func:`convert`, with a warning).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from fusedamp import _C  # noqa: F401  (registers torch.ops.fusedamp)

Moments = Literal["fp32", "bf16", "int8"]
MOMENT_MODES = ("fp32", "bf16", "int8")
CODEC_BLOCK = 256
SCALES_SUFFIX = "_scales"
SCALE_DTYPE = torch.bfloat16
# Signed states (sign + 7 bits of magnitude in their codes) and unsigned ones (8 bits).
SIGNED_STATES = frozenset({"exp_avg", "momentum_buffer"})
CODED_DTYPES = {"bf16": torch.bfloat16, "int8": torch.uint8}


def scales_key(key: str) -> str:
    return key + SCALES_SUFFIX


def check_moments(moments: str) -> None:
    if moments not in MOMENT_MODES:
        raise ValueError(
            f"Invalid moments value: {moments!r}; expected 'fp32' (default), 'bf16' (bfloat16 "
            "moments) or 'int8' (8-bit block codes with one bfloat16 scale per 256 elements)"
        )


def codec_of(tensor: Tensor) -> str:
    """The codec a stored state tensor uses, from its dtype."""
    if tensor.dtype == torch.uint8:
        return "int8"
    if tensor.dtype == torch.bfloat16:
        return "bf16"
    return "fp32"


def encode(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(uint8 codes in ``values``' memory format, bfloat16 scales), on ``values``' device."""
    codes, scales = torch.ops.fusedamp.encode_state(values.detach().float().cpu(), signed)
    return codes.to(values.device), scales.to(values.device)


def decode(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """The float32 values of ``codes`` and their ``scales`` (bfloat16; float32: the earlier
    format, see :func:`decode_earlier`), on the codes' device."""
    if scales.dtype == torch.float32:
        return decode_earlier(codes, scales, signed)
    values = torch.ops.fusedamp.decode_state(codes.cpu(), scales.cpu(), signed)
    return values.to(codes.device)


def decode_earlier(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """The float32 values of the 8-bit codes of earlier fusedamp builds: a code's magnitude is a tiny
    float (signed: 4 exponent and 3 mantissa bits under the sign; unsigned: 5 and 3) whose
    exponent field E in [1, 2^e - 1] stands for 2^(E - (2^e - 1)) (1 + M / 8) * scale, and E = 0
    for zero (M = 0), NaN (M = 1) or inf (M = 2); ``scales``: one power-of-two float32 per block
    of 256 codes in storage order, or per element (shaped like ``codes``)."""
    flat = codes.as_strided((codes.numel(),), (1,)).to(torch.int32)
    if scales.shape == codes.shape:
        per_element = scales.as_strided((codes.numel(),), (1,)).double()
    else:
        per_element = scales.double().repeat_interleave(CODEC_BLOCK)[: codes.numel()]
    exponent_bits = 4 if signed else 5
    magnitude = flat & (0x7F if signed else 0xFF)
    exponent, mantissa = magnitude >> 3, (magnitude & 7).double()
    values = torch.ldexp(1 + mantissa / 8, exponent - (2**exponent_bits - 1)) * per_element
    special = torch.where(mantissa == 1, torch.nan, torch.where(mantissa == 2, torch.inf, 0.0))
    values = torch.where(exponent == 0, special.double(), values)
    if signed:
        values = torch.where((flat & 0x80) != 0, -values, values)
    out = torch.empty_like(codes, dtype=torch.float32)
    out.as_strided((codes.numel(),), (1,)).copy_(values)
    return out


def float_value(state: dict[str, Any], key: str) -> Tensor:
    """State ``key`` as float32 values (a new tensor unless it is stored as float32)."""
    stored = state[key]
    if stored.dtype == torch.uint8:
        return decode(stored, state[scales_key(key)], key in SIGNED_STATES)
    return stored.float()


def is_earlier_format(state: dict[str, Any], key: str) -> bool:
    """Whether state ``key`` holds the 8-bit codes of earlier fusedamp builds (float32 scales)."""
    scales = state.get(scales_key(key))
    return isinstance(scales, Tensor) and scales.dtype == torch.float32


def store(state: dict[str, Any], key: str, values: Tensor, moments: str) -> None:
    """Stores float32 ``values`` as state ``key`` under the ``moments`` codec (scales included)."""
    state.pop(scales_key(key), None)
    if moments == "int8":
        state[key], state[scales_key(key)] = encode(values, key in SIGNED_STATES)
    elif moments == "bf16":
        state[key] = values.to(torch.bfloat16)
    else:
        state[key] = values


def convert(state: dict[str, Any], keys: tuple[str, ...], moments: str, fp32_dtype: torch.dtype) -> None:
    """Re-stores each moment of ``keys`` that ``state`` holds in another codec than ``moments``
    (a torch.optim state being quantized, or a group whose codec changed). ``fp32_dtype``: the
    dtype of the fp32 codec for this param (float32; float64 / complex params keep their own)."""
    wanted = CODED_DTYPES.get(moments, fp32_dtype)
    for key in keys:
        stored = state.get(key)
        if key == "step" or key.endswith(SCALES_SUFFIX) or not isinstance(stored, Tensor):
            continue
        earlier = stored.dtype == torch.uint8 and is_earlier_format(state, key)
        if stored.dtype == wanted and (moments != "int8" or scales_key(key) in state) and not earlier:
            continue
        if earlier:
            warnings.warn(
                f"optimizer state {key!r} holds the 8-bit codes of an earlier fusedamp build (float32 "
                "scales); converted to the current codes (decoded exactly, encoded again to "
                "nearest). Save the state again to keep it in the current format.",
                stacklevel=4,
            )
        values = float_value(state, key)
        store(state, key, values.to(fp32_dtype) if moments == "fp32" else values, moments)

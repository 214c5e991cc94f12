"""How an optimizer's per-element states are stored ([note: state codecs] in csrc/registration.cpp):
float32, bfloat16, or 8-bit block codes with one float32 scale per 256 elements (csrc/include/
fusedamp/math/codec.h), and the conversions between them and float32.

A moment ``key`` of an ``"int8"`` state is a uint8 tensor of codes in the param's memory format,
with its scales under ``key + "_scales"`` (1-D float32, one per block of 256 elements in storage
order). The optimizer steps store bf16 and int8 states rounded stochastically ([note: unbiased
state rounding] in codec.h); the conversions here round to nearest.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from fusedamp import _C  # noqa: F401  (registers torch.ops.fusedamp)

Moments = Literal["fp32", "bf16", "int8"]
MOMENT_MODES = ("fp32", "bf16", "int8")
CODEC_BLOCK = 256
SCALES_SUFFIX = "_scales"
# Signed states (sign + 4 exponent bits in their codes) and unsigned ones (5 exponent bits).
SIGNED_STATES = frozenset({"exp_avg", "momentum_buffer"})
CODED_DTYPES = {"bf16": torch.bfloat16, "int8": torch.uint8}


def scales_key(key: str) -> str:
    return key + SCALES_SUFFIX


def check_moments(moments: str) -> None:
    if moments not in MOMENT_MODES:
        raise ValueError(
            f"Invalid moments value: {moments!r}; expected 'fp32' (default), 'bf16' (bfloat16 "
            "moments) or 'int8' (8-bit block codes with one float32 scale per 256 elements)"
        )


def codec_of(tensor: Tensor) -> str:
    """The codec a stored state tensor uses, from its dtype."""
    if tensor.dtype == torch.uint8:
        return "int8"
    if tensor.dtype == torch.bfloat16:
        return "bf16"
    return "fp32"


def encode(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(uint8 codes in ``values``' memory format, float32 scales), on ``values``' device."""
    codes, scales = torch.ops.fusedamp.encode_state(values.detach().float().cpu(), signed)
    return codes.to(values.device), scales.to(values.device)


def decode(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """The float32 values of ``codes`` and their ``scales``, on the codes' device."""
    values = torch.ops.fusedamp.decode_state(codes.cpu(), scales.cpu(), signed)
    return values.to(codes.device)


def float_value(state: dict[str, Any], key: str) -> Tensor:
    """State ``key`` as float32 values (a new tensor unless it is stored as float32)."""
    stored = state[key]
    if stored.dtype == torch.uint8:
        return decode(stored, state[scales_key(key)], key in SIGNED_STATES)
    return stored.float()


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
        if stored.dtype == wanted and (moments != "int8" or scales_key(key) in state):
            continue
        values = float_value(state, key)
        store(state, key, values.to(fp32_dtype) if moments == "fp32" else values, moments)

"""Master weights of half params: the fp32 master or the bf16 remainder a param's state holds,
the dtypes of its state, and the conversions between them."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

MasterWeights = bool | Literal["remainder", "stochastic"]

# The state entries holding the fp32 value of a half param; at most one is present.
MASTER_KEY = "master"
REMAINDER_KEY = "master_remainder"

HALF_DTYPES = (torch.float16, torch.bfloat16)


def split_bf16_remainder(master: Tensor) -> tuple[Tensor, Tensor]:
    """Splits fp32 ``master`` into a bf16 param and an int16 remainder that rebuild it exactly
    (a NaN master gives a NaN param), in ``master``'s memory format and on its device.

    The rule is csrc/include/fusedamp/math/master.h's ([note: remainder encoding]), run by the
    CPU op ``fusedamp::split_bf16_remainder``; tensors on other devices go through the CPU
    (this runs once per param, when its master state is made).

    >>> param, remainder = split_bf16_remainder(torch.tensor([1.0 + 2**-20]))
    >>> join_bf16_remainder(param, remainder)
    tensor([1.0000])
    """
    param, remainder = torch.ops.fusedamp.split_bf16_remainder(master.detach().cpu())
    return param.to(master.device), remainder.to(master.device)


def join_bf16_remainder(param: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master that a bf16 ``param`` and its int16 ``remainder`` encode (a new tensor on
    ``param``'s device, in its memory format).

    >>> join_bf16_remainder(torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))
    tensor([1., 1.])
    """
    master = torch.ops.fusedamp.join_bf16_remainder(param.detach().cpu(), remainder.cpu())
    return master.to(param.device)


def master_key_for(mode: MasterWeights, dtype: torch.dtype) -> str | None:
    if dtype not in HALF_DTYPES or mode is False or mode == "stochastic":
        return None
    return REMAINDER_KEY if mode == "remainder" else MASTER_KEY


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a param's moments: float32 for float32/float16/bfloat16 params (the fused
    kernels' math), the param's own for float64 and complex params, as torch.optim keeps them."""
    return torch.float32 if param_dtype in (torch.float32, *HALF_DTYPES) else param_dtype


def convert_master(param: Tensor, state: dict[str, Any], master_key: str | None) -> None:
    """Makes ``master_key`` the only master entry of ``state``, keeping the fp32 value.

    Used when a state has no master yet (a fresh param, a torch.optim state_dict) or one of the
    other kind (master_weights changed); a remainder's param is rewritten so the pair is exact.
    """
    if MASTER_KEY in state:
        master = state.pop(MASTER_KEY)
    elif REMAINDER_KEY in state:
        master = join_bf16_remainder(param, state.pop(REMAINDER_KEY))
    else:
        master = param.detach().float()
    if master_key == MASTER_KEY:
        state[MASTER_KEY] = master
    elif master_key == REMAINDER_KEY:
        high, remainder = split_bf16_remainder(master)
        param.copy_(high)
        state[REMAINDER_KEY] = remainder

"""The offload keywords of the fused optimizers, their checks, and the rules of what offload takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from fusedamp import _dtensor

OffloadTarget = Literal["cpu"]
OFFLOAD_TARGETS = (None, "cpu")
# Undelayed steps before offload_delay=1 delays the update: ZeRO-Offload's choice (its delayed
# parameter update starts after a few dozen steps, once the grads change less from step to step).
DELAY_WARMUP = 40
# The state_dict() entry of a param's update that the param does not hold yet (offload_delay=1).
DELAYED_KEY = "delayed_param"

MULTI_RANK = (
    "offload_gradients and step_in_backward act in backward, before DistributedDataParallel "
    "all-reduces the grads: under a process group of more than one rank use offload='cpu' alone "
    "(step() then copies the reduced grads)"
)


@dataclass(frozen=True)
class OffloadOptions:
    """The offload keywords of an optimizer, checked (docs/offload.md).

    >>> OffloadOptions.checked("cpu", offload_delay=1, offload_delay_warmup=10)
    OffloadOptions(offload_gradients=False, step_in_backward=False, delay=1, delay_warmup=10)
    """

    offload_gradients: bool = False
    step_in_backward: bool = False
    delay: int = 0  # 1: the CPU step of step t overlaps the forward and backward of step t + 1
    delay_warmup: int = DELAY_WARMUP  # applied steps before the update is delayed

    @classmethod
    def checked(
        cls,
        offload: str | None,
        offload_gradients: bool = False,
        step_in_backward: bool = False,
        offload_delay: int = 0,
        offload_delay_warmup: int = DELAY_WARMUP,
        max_grad_norm: float | None = None,
    ) -> OffloadOptions | None:
        """The options of a constructor's offload keywords (None: no offload), or a clear error."""
        if offload not in OFFLOAD_TARGETS:
            raise ValueError(
                f"Invalid offload value: {offload!r}; expected None (state and step on the params' "
                "device) or 'cpu' (state and step on the host, params and grads on their device)"
            )
        if offload_delay not in (0, 1) or isinstance(offload_delay, bool):
            raise ValueError(
                f"Invalid offload_delay value: {offload_delay!r}; expected 0 (each step's update is in "
                "the next forward) or 1 (one step late: the CPU step overlaps the next forward and backward)"
            )
        if not isinstance(offload_delay_warmup, int) or offload_delay_warmup < 0:
            raise ValueError(f"offload_delay_warmup must be an int >= 0, got {offload_delay_warmup!r}")
        if offload is None:
            if offload_gradients or step_in_backward or offload_delay:
                raise ValueError("offload_gradients, step_in_backward and offload_delay need offload='cpu'")
            return None
        if step_in_backward and max_grad_norm is not None:
            raise ValueError(
                "step_in_backward=True steps each param as its grad arrives, before the global grad norm "
                "that max_grad_norm clips by is known: use one or the other"
            )
        if step_in_backward and offload_delay:
            raise ValueError(
                "step_in_backward=True steps each param during the backward that made its grad, and "
                "offload_delay=1 during the next forward and backward: use one or the other"
            )
        if (offload_gradients or step_in_backward) and not grads_final_in_backward():
            raise ValueError(MULTI_RANK)
        return cls(offload_gradients, step_in_backward, offload_delay, offload_delay_warmup)


def grads_final_in_backward() -> bool:
    """Whether a grad is final when its post-accumulate-grad hook runs: not under a process group
    of more than one rank, where DDP all-reduces the grads after the hooks."""
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def device_of(params: Sequence[Tensor], name: str) -> torch.device:
    """The one device of ``params``, or a clear error for what offload does not take."""
    for index, param in enumerate(params):
        if _dtensor.is_dtensor(param):
            raise TypeError(
                f"{name}(offload='cpu') offloads plain params; param {index} is a DTensor (FSDP2, "
                "tensor parallel). FSDP2 has its own offload: fully_shard(module, "
                "offload_policy=CPUOffloadPolicy()) keeps the shards and their grads on the host, "
                f"where a {name} without offload steps them (docs/offload.md)"
            )
    devices = sorted({str(param.device) for param in params})
    if len(devices) > 1:
        raise ValueError(
            f"{name}(offload='cpu') needs every param on one device; they are on {', '.join(devices)} "
            "(make one optimizer per device)"
        )
    device = params[0].device if params else torch.device("cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{name}(offload='cpu') offloads from a CUDA device (or, with plain copies, from the "
            f"CPU); the params are on {device}"
        )
    return device

"""The read-only pass over an optimizer's grads (found_inf and, for clipping, the norm) and the
clip coefficient, for plain and DTensor (FSDP2) grads."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from fusedamp import _dtensor, ops
from fusedamp.optim._step import on_device

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
CLIP_EPS = 1e-6


def check_and_norm(
    grads_and_devices: Iterable[tuple[Tensor, torch.device]], inv_scale: Tensor | None, with_norm: bool
) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
    """found_inf and, ``with_norm``, the sum of squares of the unscaled grads per device.

    found_inf is this rank's (GradScaler combines the ranks'). The sums of DTensor grads
    are summed over the mesh dims that shard them (not their Replicate ones), so that the norm
    is the global norm with each element counted once; plain grads next to them count once, as
    replicated params do.
    """
    grads: dict[torch.device, list[Tensor]] = {}
    sharded: dict[torch.device, list[Tensor]] = {}
    for grad, device in grads_and_devices:
        (sharded if _dtensor.is_dtensor(grad) else grads).setdefault(device, []).append(grad)
    found: dict[torch.device, Tensor] = {}
    sums: dict[torch.device, Tensor] = {}
    for device in [*grads, *(device for device in sharded if device not in grads)]:
        found[device] = torch.zeros((), dtype=torch.float32, device=device)
        if with_norm:
            sums[device] = torch.zeros((), dtype=torch.float32, device=device)
        device_inv_scale = on_device(inv_scale, device)
        for mesh, dims, members in _dtensor.norm_groups(sharded.get(device, [])):
            sharded_sum = torch.zeros((), dtype=torch.float32, device=device) if with_norm else None
            local_grads = [_dtensor.local(grad) for grad in members]
            ops.check_and_norm_(local_grads, found[device], sharded_sum, device_inv_scale)
            if sharded_sum is not None:
                _dtensor.sum_over_dims_(sharded_sum, mesh, dims)
                sums[device] += sharded_sum
        if device in grads:
            ops.check_and_norm_(grads[device], found[device], sums.get(device), device_inv_scale)
    return found, sums


def clip_coefficient(sums: dict[torch.device, Tensor], max_grad_norm: float) -> tuple[Tensor, Tensor]:
    """(min(1, max_grad_norm / (norm + 1e-6)), norm) on the first grad's device, from the sums
    of squares per device."""
    devices = list(sums)
    total = sums[devices[0]].clone()
    for device in devices[1:]:
        total += on_device(sums[device], devices[0])
    norm = total.sqrt_()
    return (max_grad_norm / (norm + CLIP_EPS)).clamp_(max=1.0), norm

"""Python entry points of the fused kernels: thin wrappers over ``torch.ops.fusedamp.*``.

Every op mutates its arguments in place and returns nothing, so their fake (meta) kernels are
trivial and ``torch.compile`` can trace through them. All ops run on CPU and, when the CUDA
kernels were compiled, on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedamp import _C  # noqa: F401  (importing the extension registers torch.ops.fusedamp)

__all__ = ["unscale_", "check_and_norm_", "update_scale_", "adamw_", "sgd_"]


def unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad; sets ``found_inf`` to 1 if any grad was non-finite.

    Grads may mix float32, float16 and bfloat16. ``found_inf`` and ``inv_scale`` are float32
    one-element tensors on the grads' device; ``found_inf`` is left as it was when all are finite.
    """
    torch.ops.fusedamp.unscale_(grads, found_inf, inv_scale)


def check_and_norm_(
    grads: list[Tensor],
    found_inf: Tensor,
    sum_of_squares: Tensor | None = None,
    inv_scale: Tensor | None = None,
) -> None:
    """Read-only pass: sets ``found_inf`` like :func:`unscale_` and, when ``sum_of_squares`` is
    given, adds ``sum((g * inv_scale) ** 2)`` over every element of every grad to it."""
    torch.ops.fusedamp.check_and_norm_(grads, found_inf, sum_of_squares, inv_scale)


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """Dynamic loss-scale update on the device (torch's rule, plus hysteresis and bounds).

    On ``found_inf > 0``: the growth tracker resets, one unit of hysteresis is spent, and once
    none is left the scale is multiplied by ``backoff_factor`` (not below ``min_scale``). After
    ``growth_interval`` clean steps the scale is multiplied by ``growth_factor`` (not above
    ``max_scale``, never to inf) and the hysteresis is refilled.
    """
    torch.ops.fusedamp.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale,
    )


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
    inv_grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    clip_coef: Tensor | None = None,
    write_unscaled_grads: bool = True,
) -> None:
    """One fused AdamW step over same-dtype, same-device lists (see csrc/registration.cpp)."""
    lr_value, lr_tensor = _split_lr(lr)
    torch.ops.fusedamp.adamw_(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, lr_value,
        lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, inv_grad_scale, found_inf,
        clip_coef, write_unscaled_grads,
    )


def sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    inv_grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    clip_coef: Tensor | None = None,
    write_unscaled_grads: bool = True,
) -> None:
    """One fused SGD step over same-dtype, same-device lists (see csrc/registration.cpp)."""
    lr_value, lr_tensor = _split_lr(lr)
    torch.ops.fusedamp.sgd_(
        params, grads, momentum_buffers, masters, steps, lr_value, lr_tensor, momentum,
        dampening, weight_decay, nesterov, maximize, inv_grad_scale, found_inf, clip_coef,
        write_unscaled_grads,
    )


def _split_lr(lr: float | Tensor) -> tuple[float, Tensor | None]:
    if isinstance(lr, Tensor):
        return 0.0, lr
    return float(lr), None


# In-place ops return nothing: their fake kernels only need to exist.
for _name in ("unscale_", "check_and_norm_", "update_scale_", "adamw_", "sgd_"):
    torch.library.register_fake(f"fusedamp::{_name}")(lambda *args, **kwargs: None)

"""What one bucket's step needs besides the op: the bucket itself, the AMP scalars, the layouts the
kernels walk, and torch's ops for the dtypes the kernels do not take."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fusedamp._layout import has_kernel, is_dense, like, real_view, same_order
from fusedamp.optim import _codecs
from fusedamp.optim._masters import HALF_DTYPES, master_key_for


def on_device(tensor: Tensor | None, device: torch.device) -> Tensor | None:
    """``tensor`` (an AMP scalar) on ``device``; None stays None."""
    if tensor is None or tensor.device == device:
        return tensor
    # A CPU kernel reads its scalars on the host at once, so a copy to the CPU must be complete.
    return tensor.to(device, non_blocking=device.type != "cpu")


def lr_for_device(lr: float | Tensor, device: torch.device) -> float | Tensor:
    """A tensor lr as the op takes it: float32, on the CPU (read on the host) or on ``device``."""
    if not isinstance(lr, Tensor):
        return lr
    if lr.device.type != "cpu" and lr.device != device:
        lr = lr.to(device)
    return lr if lr.dtype == torch.float32 else lr.float()


@dataclass
class Bucket:
    """The params of one op call: same group, device, param dtype and grad dtype.

    ``params`` and ``grads`` are what the kernels walk: dense, in the same element order, complex
    ones as real views. ``write_backs`` pairs each user tensor that could not be handed over
    as it is with the copy the step updates; ``grad_write_backs`` does so for grads, copied back
    only when the step writes the grads it used.
    """

    group: dict[str, Any]
    device: torch.device
    master_key: str | None
    state_keys: tuple[str, ...]  # the entries besides the master that each param's state needs
    native: bool  # float64 / complex128: torch's ops step it, not fusedamp's kernels
    complex: bool  # complex params: the kernels get the real views of params, grads and moments
    stochastic: bool = False  # half params rounded stochastically (master_weights="stochastic")
    grad_dtype: torch.dtype | None = None  # the grads' as the kernels get them
    param_ids: list[int] = field(default_factory=list)  # the params' indices in the optimizer
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    write_backs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    grad_write_backs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # The op call, made at the first step of the bucket (_plan.op_call); in a StepPlan's
    # buckets it reads the grads from the params at each call instead of from ``grads``.
    call: Callable[..., None] | None = None
    grads_from_params: bool = False

    @classmethod
    def of(
        cls, group: dict[str, Any], param: Tensor, moment_keys: tuple[str, ...], grad_dtype: torch.dtype
    ) -> Bucket:
        """An empty bucket for params like ``param`` in ``group``, whose state has ``moment_keys``
        (8-bit moments add their scales) besides the step count and the master."""
        dtype = param.dtype
        if group["moments"] == "int8":
            moment_keys = (*moment_keys, *map(_codecs.scales_key, moment_keys))
        return cls(
            group, param.device, master_key_for(group["master_weights"], dtype), ("step", *moment_keys),
            native=not has_kernel(dtype), complex=param.is_complex(),
            stochastic=group["master_weights"] == "stochastic" and dtype in HALF_DTYPES,
            grad_dtype=grad_dtype,
        )

    def add(self, param: Tensor, grad: Tensor) -> Tensor:
        """Adds a plain (local) ``param`` and its ``grad`` as the kernels walk them side by side:
        the param itself when it is dense (else a contiguous copy, written back after the step),
        the grad itself when it is dense in the param's element order and of the bucket's grad
        dtype (else a copy, written back when the step writes grads). Returns the param as the
        kernels step it, which its state is made like."""
        # The common case, both contiguous and of the bucket's dtypes, takes no further look.
        if not param.is_contiguous() and not is_dense(param):
            work_param = param.detach().contiguous()
            self.write_backs.append((param, work_param))
            param = work_param
        if grad.dtype != self.grad_dtype or not (
            (grad.is_contiguous() and param.is_contiguous()) or (is_dense(grad) and same_order(grad, param))
        ):
            # Also fp16 params with bf16 grads (or the reverse), which the kernels do not pair:
            # through an fp32 copy of the grads (exact).
            work_grad = like(grad, param, self.grad_dtype)
            self.grad_write_backs.append((grad, work_grad))
            grad = work_grad
        self.params.append(real_view(param) if self.complex else param)
        self.grads.append(real_view(grad) if self.complex else grad)
        return param

    def state_list(self, key: str) -> list[Tensor]:
        if self.complex:
            return [real_view(state[key]) for state in self.states]
        return [state[key] for state in self.states]

    def masters(self) -> list[Tensor]:
        return [] if self.master_key is None else self.state_list(self.master_key)

    def scales(self, key: str) -> list[Tensor] | None:
        """The scale lists of state ``key`` when the group stores it as 8-bit codes, else None."""
        if self.group["moments"] != "int8":
            return None
        return [state[_codecs.scales_key(key)] for state in self.states]

    def rounding(self) -> dict[str, Any]:
        """The op keywords of the step's random bits: the params' ids and the group's seed (coded
        states always round stochastically), and whether the params do."""
        return {
            "rounding_ids": self.param_ids,
            "rounding_seed": self.group["seed"],
            "stochastic_params": self.stochastic,
        }


@dataclass
class AmpScalars:
    """The device tensors that turn a plain step into an AMP step (None: not used)."""

    inv_grad_scale: Tensor | None
    found_inf: Tensor | None
    clip_coef: Tensor | None

    def writes_grads(self, write_unscaled_grads: bool) -> bool:
        """Whether a step writes the grads it used back (StepInputs.write_grad of the fused ops,
        csrc/common/inputs.cpp check_step_inputs)."""
        return write_unscaled_grads and (self.inv_grad_scale is not None or self.clip_coef is not None)

    def op_keywords(self, bucket: Bucket) -> dict[str, Any]:
        """The keywords every fused step op (torch.ops.fusedamp.adamw_, sgd_) takes alike, for a
        bucket: its group's lr (a float, or a tensor on the bucket's device) and maximize, and
        these AMP scalars."""
        group = bucket.group
        lr = lr_for_device(group["lr"], bucket.device)
        return {
            "lr": 0.0 if isinstance(lr, Tensor) else float(lr),
            "lr_tensor": lr if isinstance(lr, Tensor) else None,
            "maximize": group["maximize"],
            "inv_grad_scale": self.inv_grad_scale,
            "found_inf": self.found_inf,
            "clip_coef": self.clip_coef,
            "write_unscaled_grads": group["write_unscaled_grads"],
        }


def native_grads(bucket: Bucket, scalars: AmpScalars) -> list[Tensor]:
    """The grads of a bucket without a fused kernel, unscaled and clipped as torch would do it
    (multiplied by inv_grad_scale, then by clip_coef); written back into the grads when the step
    writes grads, as fusedamp's kernels do."""
    grads = bucket.grads
    write = scalars.writes_grads(bucket.group["write_unscaled_grads"])
    for multiplier in (scalars.inv_grad_scale, scalars.clip_coef):
        if multiplier is None:
            continue
        if write:
            torch._foreach_mul_(grads, multiplier)
        else:
            grads = torch._foreach_mul(grads, multiplier)
    return grads


def advance_steps(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """steps += 1 unless found_inf is set ([note: found_inf]), on the device, without a sync."""
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        torch._foreach_add_(steps, (found_inf == 0).float())

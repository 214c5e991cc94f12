"""FusedSGD: torch.optim.SGD with fp32 master weights, AMP and clipping in one fused step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fusedamp.optim._base import FusedOptimizer, check_lr, torch_flags
from fusedamp.optim._codecs import Moments
from fusedamp.optim._masters import MasterWeights
from fusedamp.optim._step import AmpScalars, Bucket, advance_steps, lr_for_device, native_grads
from fusedamp.optim.offload import DELAY_WARMUP, OffloadOptions, OffloadTarget

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizer):
    """SGD (momentum, dampening, Nesterov, weight decay) updated by one fused kernel per bucket.

    Same arguments, defaults, validation and ``"momentum_buffer"`` state as
    ``torch.optim.SGD``; ``master_weights``, ``max_grad_norm``, ``write_unscaled_grads``,
    ``moments`` (here: how the momentum buffer is stored), ``seed`` and the offload keywords
    (``offload``, ``offload_gradients``, ``step_in_backward``, ``offload_delay``,
    ``offload_delay_warmup``) work as in
    :class:`fusedamp.FusedAdamW`. Each param also has a ``"step"`` count (a float32 0-dim
    tensor on its device): the first step of a param (count 0) starts its momentum buffer as
    the grad itself, as torch does.

    torch's ``foreach`` and ``fused`` are accepted (the step is always fused);
    ``differentiable=True`` is an error. Params may be in any memory format, float64 (stepped
    with torch's ops, in torch's order) or complex (stepped as pairs of reals).

    >>> opt = fusedamp.FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    >>> loss_fn(model(x)).backward()
    >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float | Tensor = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: MasterWeights = True,
        max_grad_norm: float | None = None,
        write_unscaled_grads: bool = True,
        moments: Moments = "fp32",
        seed: int = 0,
        offload: OffloadTarget | None = None,
        offload_gradients: bool = False,
        step_in_backward: bool = False,
        offload_delay: int = 0,
        offload_delay_warmup: int = DELAY_WARMUP,
    ) -> None:
        check_lr(lr)
        if not 0.0 <= momentum:  # NaN fails too
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:  # NaN fails too
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if isinstance(weight_decay, Tensor):  # the fused op takes a float
            weight_decay = float(weight_decay)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
            "master_weights": master_weights,
            "write_unscaled_grads": write_unscaled_grads,
            "moments": moments,
            "seed": seed,
            **torch_flags(foreach, fused, False, differentiable),
        }
        offload_options = OffloadOptions.checked(
            offload, offload_gradients, step_in_backward, offload_delay, offload_delay_warmup, max_grad_norm
        )
        super().__init__(params, defaults, max_grad_norm, offload_options)

    _takes_sparse_grads = True  # nn.Embedding(sparse=True), as torch.optim.SGD

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _new_state(self, key: str, param: Tensor, state: dict[str, Any], moments: str = "fp32") -> Tensor:
        if key == "step" and "momentum_buffer" in state:
            # A torch.optim.SGD state (buffer, no count): the buffer is live, not to be reset.
            return torch.ones((), dtype=torch.float32, device=param.device)
        if key == "momentum_buffer" and "step" in state:
            # Momentum switched on after steps without it: torch.optim.SGD starts a missing buffer
            # as the grad, which the kernels do at step count 0 (in place: the plan keeps it).
            state["step"].zero_()
        return super()._new_state(key, param, state, moments)

    _op = "sgd_"
    _float_options = ("lr", "momentum", "dampening", "weight_decay")
    _call_options = frozenset(
        {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "write_unscaled_grads"}
    )

    def _op_lists(self, bucket: Bucket) -> list[list[Tensor]]:
        buffers = bucket.state_list("momentum_buffer") if bucket.group["momentum"] != 0 else []
        return [bucket.params, bucket.grads, buffers, bucket.masters(), bucket.state_list("step")]

    def _op_keywords(self, bucket: Bucket, scalars: AmpScalars) -> dict[str, Any]:
        group = bucket.group
        return {
            "momentum": group["momentum"],
            "dampening": group["dampening"],
            "weight_decay": group["weight_decay"],
            "nesterov": group["nesterov"],
            "momentum_buffer_scales": bucket.scales("momentum_buffer") if group["momentum"] != 0 else None,
            **bucket.rounding(),
            **scalars.op_keywords(bucket),
        }

    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None:
        # torch.optim.SGD's single-tensor ops in its order (so float64 results are torch's),
        # with the first step and found_inf selected on the device instead of on the host.
        group = bucket.group
        momentum, dampening = group["momentum"], group["dampening"]
        weight_decay, lr = group["weight_decay"], lr_for_device(group["lr"], bucket.device)
        steps = bucket.state_list("step")
        buffers = bucket.state_list("momentum_buffer") if momentum != 0 else [None] * len(steps)
        skip = None if scalars.found_inf is None else scalars.found_inf != 0
        grads = native_grads(bucket, scalars)
        for param, grad, buffer, step in zip(bucket.params, grads, buffers, steps, strict=True):
            direction = -grad if group["maximize"] else grad
            if weight_decay != 0:
                direction = direction.add(param, alpha=weight_decay)
            if buffer is not None:
                blended = buffer.mul(momentum).add_(direction, alpha=1 - dampening)
                new_buffer = torch.where(step == 0, direction, blended)
                buffer.copy_(new_buffer if skip is None else torch.where(skip, buffer, new_buffer))
                direction = direction.add(new_buffer, alpha=momentum) if group["nesterov"] else new_buffer
            if isinstance(lr, Tensor):
                updated = param - lr.to(param.device) * direction
            else:
                updated = param.add(direction, alpha=-lr)
            param.copy_(updated if skip is None else torch.where(skip, param, updated))
        advance_steps(steps, scalars.found_inf)

"""FusedAdamW: torch.optim.AdamW with fp32 master weights, AMP and clipping in one fused step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fusedamp.optim._base import FusedOptimizer, check_lr, torch_flags
from fusedamp.optim._codecs import Moments
from fusedamp.optim._masters import MasterWeights
from fusedamp.optim._step import AmpScalars, Bucket, lr_for_device, native_grads
from fusedamp.optim.offload import DELAY_WARMUP, OffloadOptions, OffloadTarget

__all__ = ["FusedAdamW"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


class FusedAdamW(FusedOptimizer):
    """AdamW (decoupled weight decay) updated by one fused kernel per device and dtype.

    Same arguments, defaults, validation and state names as ``torch.optim.AdamW``, plus:

    - ``master_weights``: for float16/bfloat16 params, ``True`` (default) keeps an fp32 copy
      (state ``"master"``) that takes the update and is rounded into the param; ``"remainder"``
      (bfloat16 params only) stores just the low 16 bits of that fp32 master (state
      ``"master_remainder"``, int16), which the bf16 param completes exactly; ``False`` updates
      the half param itself; ``"stochastic"`` (float16/bfloat16 params) keeps no master and
      rounds the fp32 update into the param stochastically, with random bits from a hash of
      (``seed``, step, the param's index in the optimizer, element): the same on CPU and CUDA,
      for any thread count, and a resumed run continues bitwise. float32 params never have a
      master.
    - ``moments``: how ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) are stored:
      ``"fp32"`` (default), ``"bf16"``, or ``"int8"``: 8-bit block codes (uint8, a code
      relative to a bfloat16 scale per block of 256 elements, under ``"<key>_scales"``, with
      the most precision near the block's largest value), about 1 byte per element. bf16 and
      int8 moments are stored rounded stochastically (unbiased, with bits from the hash ``seed``
      keys), so that changes smaller than their resolution are kept on average and long runs
      track fp32 moments. float64 and complex params keep torch's own step and need
      ``"fp32"``. ``state_bytes()`` measures what the state holds; ``torch_state_dict()``
      exports float32 moments for ``torch.optim.AdamW``.
      ``state_dict()`` holds the state of DTensor (FSDP2) params as DTensors, the 8-bit scales
      as a bfloat16 scale per element, for torch.distributed.checkpoint
      (docs/distributed-checkpoint.md).
    - ``seed``: the seed of stochastic rounding (an int, kept in the param groups, so it is
      part of ``state_dict()``).
    - ``max_grad_norm``: clip the grads to this global L2 norm (over every param of the
      optimizer that has a grad) inside the step, as ``torch.nn.utils.clip_grad_norm_`` would;
      ``None`` (default) is off. ``last_grad_norm`` then holds the norm of the last step as a
      device tensor (``float("inf")`` measures without clipping).
    - ``write_unscaled_grads``: when the step unscales or clips the grads, it writes the values
      it used back into ``.grad`` as torch does (default); ``False`` saves that write for code
      that zeroes the grads right after the step.
    - ``offload="cpu"``: the state and the step on the host, the params and grads on their
      device (one CUDA device); the grads go to the host in buckets as backward makes them, the
      CPU steps the params in the order their grads land and they come back while it steps the
      rest, with the same bits as without offload. ``offload_gradients=True`` frees each grad on
      the device once it is on the host; ``step_in_backward=True`` steps each param as soon as its
      grad landed (no clipping, no GradScaler); ``offload_delay=1`` delays each update by one
      step (after ``offload_delay_warmup`` applied steps, default 40), so that the CPU step runs
      during the next forward and backward, ZeRO-Offload's delayed parameter update;
      ``offload_no_sync()`` marks the micro-batches of gradient accumulation before the last,
      ``offload_flush()`` puts a delayed update into the params now. See docs/offload.md.

    ``lr`` may be a float or a one-element tensor. Under a ``torch.amp.GradScaler`` or
    ``fusedamp.GradScaler``, ``scaler.step(opt)`` unscales, checks for inf/NaN and (optionally)
    clips inside the fused step without a host sync.

    torch's ``foreach``, ``fused`` and ``capturable`` are accepted (the step is always fused and
    keeps its step counts on the device); ``differentiable=True`` is an error. Params may be in
    any memory format (state follows it), float64 or complex: complex params are stepped as
    pairs of reals, float64 ones by torch's fused AdamW kernel.

    >>> opt = fusedamp.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> loss_fn(model(x)).backward()
    >>> opt.step()
    >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
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
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "master_weights": master_weights,
            "write_unscaled_grads": write_unscaled_grads,
            "moments": moments,
            "seed": seed,
            **torch_flags(foreach, fused, capturable, differentiable),
        }
        offload_options = OffloadOptions.checked(
            offload, offload_gradients, step_in_backward, offload_delay, offload_delay_warmup, max_grad_norm
        )
        super().__init__(params, defaults, max_grad_norm, offload_options)

    def _check_hyperparameters(self) -> None:
        super()._check_hyperparameters()
        check_adamw_groups(type(self).__name__, enumerate(self.param_groups))

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return adamw_moment_keys(group)

    _op = "adamw_"
    _call_options = frozenset({"lr", "betas", "eps", "weight_decay", "maximize", "write_unscaled_grads"})
    _float_options = ("lr", "betas", "eps", "weight_decay")

    def _op_lists(self, bucket: Bucket) -> list[list[Tensor]]:
        return adamw_op_lists(bucket)

    def _op_keywords(self, bucket: Bucket, scalars: AmpScalars) -> dict[str, Any]:
        return adamw_op_keywords(bucket, scalars)

    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None:
        adamw_step_native(bucket, scalars)


def adamw_moment_keys(group: dict[str, Any]) -> tuple[str, ...]:
    """The moments an AdamW group's params keep."""
    if group["amsgrad"]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    return ("exp_avg", "exp_avg_sq")


def check_adamw_groups(name: str, groups: Iterable[tuple[int, dict[str, Any]]]) -> None:
    """The constructor's betas rule for betas changed after it (a beta1 of 1 divides by zero, as
    torch raises); a float lr whose first bias-corrected step size, lr / (1 - beta1), overflows
    float32 is refused as torch's conversion refuses it. ``groups``: (index, group) pairs."""
    for index, group in groups:
        betas, lr = group["betas"], group["lr"]
        for position, beta in enumerate(betas):
            if isinstance(beta, float) and not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {position}: {beta} (param group {index})")
        if isinstance(lr, float) and isinstance(betas[0], float) and lr / (1.0 - betas[0]) > _FLOAT32_MAX:
            raise ValueError(
                f"{name}: lr={lr} in param group {index}: the step size lr / (1 - beta1) overflows float32"
            )


def adamw_op_lists(bucket: Bucket) -> list[list[Tensor]]:
    """The tensor lists of adamw_ for an AdamW bucket."""
    return [
        bucket.params,
        bucket.grads,
        bucket.state_list("exp_avg"),
        bucket.state_list("exp_avg_sq"),
        bucket.state_list("max_exp_avg_sq") if bucket.group["amsgrad"] else [],
        bucket.masters(),
        bucket.state_list("step"),
    ]


def adamw_op_keywords(bucket: Bucket, scalars: AmpScalars) -> dict[str, Any]:
    """The other arguments of adamw_ for an AdamW bucket, read from its group at each step."""
    group = bucket.group
    beta1, beta2 = group["betas"]
    return {
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "amsgrad": group["amsgrad"],
        "exp_avg_scales": bucket.scales("exp_avg"),
        "exp_avg_sq_scales": bucket.scales("exp_avg_sq"),
        "max_exp_avg_sq_scales": bucket.scales("max_exp_avg_sq") if group["amsgrad"] else None,
        **bucket.rounding(),
        **scalars.op_keywords(bucket),
    }


def adamw_step_native(bucket: Bucket, scalars: AmpScalars) -> None:
    """The step of a float64 / complex128 AdamW bucket, by torch's fused AdamW kernel, which reads
    the step count after the increment and skips on found_inf == 1."""
    group = bucket.group
    beta1, beta2 = group["betas"]
    steps = bucket.state_list("step")
    found_inf = None if scalars.found_inf is None else (scalars.found_inf != 0).float()
    grads = native_grads(bucket, scalars)
    torch._foreach_add_(steps, 1.0)
    torch._fused_adamw_(
        bucket.params,
        grads,
        bucket.state_list("exp_avg"),
        bucket.state_list("exp_avg_sq"),
        bucket.state_list("max_exp_avg_sq") if group["amsgrad"] else [],
        steps,
        lr=lr_for_device(group["lr"], bucket.device),
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=group["amsgrad"],
        maximize=group["maximize"],
        found_inf=found_inf,
    )
    if found_inf is not None:
        torch._foreach_sub_(steps, [found_inf] * len(steps))

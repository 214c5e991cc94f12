"""FusedMuon: torch.optim.Muon for the hidden matrices and AdamW for the rest, in one optimizer,
with fp32 master weights, 8-bit momentum and the AMP step fused."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from fusedamp import _dtensor
from fusedamp.optim._base import FusedOptimizer, check_lr, torch_flags
from fusedamp.optim._codecs import Moments
from fusedamp.optim._masters import MasterWeights
from fusedamp.optim._plan import op_call
from fusedamp.optim._step import AmpScalars, Bucket, advance_steps, lr_for_device, native_grads
from fusedamp.optim.adamw import (
    adamw_moment_keys,
    adamw_op_keywords,
    adamw_op_lists,
    adamw_step_native,
    check_adamw_groups,
)
from fusedamp.optim.offload import DELAY_WARMUP, OffloadOptions, OffloadTarget

__all__ = ["FusedMuon", "muon_param_groups", "orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
# What an AdamW group (use_muon=False) takes for the options it does not set: torch.optim.AdamW's
# defaults, not the Muon groups' (whose eps and weight_decay mean other things).
ADAMW_GROUP_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False}


def orthogonalize(
    updates: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """Newton-Schulz orthogonalization of a batch of same-shape matrices ``updates`` (..., A, B),
    torch.optim.Muon's quintic iteration on each, in ``updates``' dtype: each matrix divided by
    its Frobenius norm (at least ``eps``), then ``steps`` times X <- a X + (b G + c G G) X with
    G = X X^T, on the wide orientation (X^T when A > B).

    >>> orthogonalize(torch.randn(3, 64, 32, dtype=torch.bfloat16), (3.4445, -4.775, 2.0315), 5, 1e-7)
    """
    a, b, c = coefficients
    x = updates.mT if updates.size(-2) > updates.size(-1) else updates
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if updates.size(-2) > updates.size(-1) else x


def adjusted_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate factor of a matrix of ``shape`` (A, B) = (fan-out, fan-in)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols)  # "spectral_unclamped"


# Up to this momentum int8 buffers stay within 3% of fp32 ones over long runs with noisy grads
# (the Muon section of docs/muon.md); above it they have not been measured.
INT8_MOMENTUM_LIMIT = 0.9999


class FusedMuon(FusedOptimizer):
    """Muon (momentum, Newton-Schulz orthogonalization, decoupled weight decay) for the 2-D hidden
    matrices, and AdamW for the param groups marked ``use_muon=False``, in one ``step()``.

    The arguments, defaults and ``"momentum_buffer"`` state of ``torch.optim.Muon`` (and its
    results: the same math, the orthogonalization in bfloat16 unless ``ns_dtype=torch.float32``),
    plus fusedamp's options as in :class:`fusedamp.FusedAdamW`: ``master_weights`` (fp32,
    ``"remainder"`` or ``"stochastic"`` for half params), ``moments`` (the momentum buffers and
    the AdamW groups' moments in ``"fp32"``, ``"bf16"`` or ``"int8"``), ``max_grad_norm`` (one
    clip over every grad of the optimizer), ``write_unscaled_grads``, ``seed``, the offload
    keywords (``offload``, ``offload_gradients``, ``step_in_backward``, ``offload_delay``,
    ``offload_delay_warmup``), and both GradScalers (a step with inf/NaN grads changes nothing).
    int8 momentum buffers track fp32 ones within 3% up to momentum 0.99; above it they fall short
    (a warning says so), and ``moments="bf16"`` is the mode to pick there.

    A group with ``use_muon=False`` is stepped as ``torch.optim.AdamW`` would: its ``lr``,
    ``betas``, ``eps``, ``weight_decay`` and ``amsgrad`` are AdamW's (unset ones take AdamW's
    defaults, not Muon's; ``lr`` the optimizer's). :func:`muon_param_groups` splits a model that
    way. Each Muon step: the unscale, clip and momentum update in one fused kernel per device and
    dtype, the orthogonalization as one batched matmul chain per matrix shape, and the weight
    decay and update of the params (and masters) in one fused kernel per shape.

    >>> opt = fusedamp.FusedMuon(fusedamp.optim.muon_param_groups(model, adamw={"lr": 3e-4}), lr=0.02)
    >>> loss_fn(model(x)).backward()
    >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
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
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": True,
            "ns_dtype": ns_dtype,
            "maximize": False,
            "master_weights": master_weights,
            "write_unscaled_grads": write_unscaled_grads,
            "moments": moments,
            "seed": seed,
            **torch_flags(None, None, False, False),
        }
        offload_options = OffloadOptions.checked(
            offload, offload_gradients, step_in_backward, offload_delay, offload_delay_warmup, max_grad_norm
        )
        super().__init__(params, defaults, max_grad_norm, offload_options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get("use_muon", self.defaults["use_muon"]):
            for key, value in ADAMW_GROUP_DEFAULTS.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        self._check_group(index, group)
        if not group["use_muon"]:
            return
        for position, param in enumerate(group["params"]):
            _check_muon_param(param, f"param {position} of group {index}")
        if group["moments"] == "int8" and group["momentum"] > INT8_MOMENTUM_LIMIT:
            warnings.warn(
                f"FusedMuon: int8 momentum buffers at momentum={group['momentum']} (param group {index}) "
                "are beyond what was measured: up to 0.9999 they move 0.98-1.00x as far as fp32 ones "
                "over 10,000 steps with noisy grads, and the rounding noise of each store adds up more "
                f"in a buffer that keeps {group['momentum']:.3%} of itself per step. moments='bf16' "
                "tracks fp32 at any momentum.",
                stacklevel=3,
            )

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        """The rules of torch.optim.Muon's constructor (and of fusedamp's ns_dtype) for a Muon
        group; an AdamW group's are FusedAdamW's."""
        if not group["use_muon"]:
            if not 0.0 <= group["eps"]:
                raise ValueError(f"Invalid epsilon value: {group['eps']} (param group {index})")
            if not 0.0 <= group["weight_decay"]:
                raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (param group {index})")
            return
        if group["maximize"]:
            raise ValueError("maximize=True is for AdamW groups; torch.optim.Muon has no maximize")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        if len(group["ns_coefficients"]) != 3:
            raise ValueError("ns_coefficients must be a tuple of exactly 3 values")
        if not isinstance(group["ns_steps"], int) or not 0 <= group["ns_steps"] < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100), got {group['ns_steps']!r}")
        if group["ns_dtype"] not in (torch.bfloat16, torch.float32):
            raise ValueError(
                "ns_dtype must be torch.bfloat16 (torch.optim.Muon's) or torch.float32, "
                f"got {group['ns_dtype']}"
            )

    def _check_hyperparameters(self) -> None:
        super()._check_hyperparameters()
        check_adamw_groups(
            type(self).__name__, ((i, g) for i, g in enumerate(self.param_groups) if not g["use_muon"])
        )

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["use_muon"] else adamw_moment_keys(group)

    # The AdamW groups' op; the Muon groups step through _MuonStep.
    _op = "adamw_"
    _call_options = frozenset(
        {"lr", "betas", "eps", "weight_decay", "momentum", "nesterov", "ns_coefficients", "ns_steps",
         "adjust_lr_fn", "write_unscaled_grads"}
    )
    _float_options = ("lr", "betas", "eps", "weight_decay", "momentum", "ns_coefficients")

    def _op_lists(self, bucket: Bucket) -> list[list[Tensor]]:
        return adamw_op_lists(bucket)

    def _op_keywords(self, bucket: Bucket, scalars: AmpScalars) -> dict[str, Any]:
        return adamw_op_keywords(bucket, scalars)

    def _step_bucket(self, bucket: Bucket, scalars: AmpScalars, **overrides: Any) -> None:
        if not bucket.group["use_muon"]:
            super()._step_bucket(bucket, scalars, **overrides)
            return
        if bucket.call is None:
            params = self._indexed_params()
            bucket.call = _MuonStep(bucket, [params[index] for index in bucket.param_ids])
        bucket.call(scalars, **overrides)

    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None:
        if not bucket.group["use_muon"]:
            adamw_step_native(bucket, scalars)
            return
        # float64 params: torch.optim.Muon's ops in its order, found_inf selected on the device.
        group = bucket.group
        skip = None if scalars.found_inf is None else scalars.found_inf != 0
        lr = lr_for_device(group["lr"], bucket.device)
        grads = native_grads(bucket, scalars)
        steps, buffers = bucket.state_list("step"), bucket.state_list("momentum_buffer")
        coefficients, ns_steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
        for param, grad, buffer in zip(bucket.params, grads, buffers, strict=True):
            new_buffer = buffer.lerp(grad, 1 - group["momentum"])
            update = grad.lerp(new_buffer, group["momentum"]) if group["nesterov"] else new_buffer
            update = orthogonalize(update.to(group["ns_dtype"]).unsqueeze(0), coefficients, ns_steps, eps)[0]
            ratio = adjusted_lr_ratio(group["adjust_lr_fn"], param.shape)
            updated = param * (1 - lr * group["weight_decay"]) - (lr * ratio) * update
            if skip is not None:
                new_buffer = torch.where(skip, buffer, new_buffer)
                updated = torch.where(skip, param, updated)
            buffer.copy_(new_buffer)
            param.copy_(updated)
        advance_steps(steps, scalars.found_inf)


def _paired(param_dtype: torch.dtype, grad_dtype: torch.dtype | None) -> bool:
    """Whether the fused steps pair these (param, grad) element types (csrc's kSteppedGradType)."""
    return param_dtype == grad_dtype or torch.float32 in (param_dtype, grad_dtype)


def _check_muon_param(param: Tensor, where: str) -> None:
    """torch.optim.Muon's rule for the params of a Muon group (real 2-D matrices), and fusedamp's
    limit: no sharded (DTensor) matrices."""
    if param.ndim != 2:
        raise ValueError(
            f"FusedMuon: {where} has shape {tuple(param.shape)}; a Muon group takes 2-D matrices "
            "only. Put the other params in a group with use_muon=False (stepped as AdamW), or "
            "build the groups with fusedamp.optim.muon_param_groups(model)"
        )
    if param.is_complex():
        raise TypeError(f"FusedMuon: {where} is complex; Muon groups take real matrices")
    if _dtensor.is_dtensor(param):
        raise NotImplementedError(
            f"FusedMuon: {where} is a DTensor (an FSDP2 or tensor-parallel shard). Muon orthogonalizes "
            "whole matrices and FusedMuon does not gather sharded ones: step such params in a group "
            "with use_muon=False (AdamW), or shard the model with DDP"
        )


class _MuonStep:
    """The Muon step of one bucket, made at its first step and kept with it: the momentum op over
    every param, one batched orthogonalization per matrix shape, and one sgd_ call per shape that
    applies the weight decay and the update at the shape's adjusted lr (sgd_ with coupled decay
    wd / ratio at lr * ratio is Muon's p (1 - lr wd) - lr ratio O), to the params and masters.
    The orthogonalized updates live in one buffer per shape, reused every step."""

    def __init__(self, bucket: Bucket, params: list[Tensor]) -> None:
        for index, param in zip(bucket.param_ids, params, strict=True):
            _check_muon_param(param, f"param {index}")  # params put into a group by hand too
        self.bucket = bucket
        group = bucket.group
        # The orthogonalization's dtype, unless the kernels have no pair of it with the grads or
        # the params (fp16 and bf16): fp32 updates then, orthogonalized as ns_dtype copies.
        self.update_dtype = group["ns_dtype"]
        param_dtype = bucket.params[0].dtype
        if not (_paired(self.update_dtype, bucket.grad_dtype) and _paired(param_dtype, self.update_dtype)):
            self.update_dtype = torch.float32
        by_shape: dict[torch.Size, list[int]] = {}
        for position, param in enumerate(bucket.params):
            by_shape.setdefault(param.shape, []).append(position)
        updates: list[Tensor | None] = [None] * len(bucket.params)
        # (shape, its orthogonalization buffer, its sgd_ call, the rounding ids of its params)
        self.shapes: list[tuple[torch.Size, Tensor, Callable[..., None], list[int]]] = []
        steps = bucket.state_list("step")
        masters = bucket.masters()
        for shape, positions in by_shape.items():
            batch = torch.empty((len(positions), *shape), dtype=self.update_dtype, device=bucket.device)
            for row, position in enumerate(positions):
                updates[position] = batch[row]
            lists = [
                [bucket.params[p] for p in positions],
                [batch[row] for row in range(len(positions))],
                [],
                [masters[p] for p in positions] if masters else [],
                [steps[p] for p in positions],
            ]
            ids = [bucket.param_ids[p] for p in positions]
            self.shapes.append((shape, batch, op_call("sgd_", lists), ids))
        momentum_lists = [updates, bucket.grads, bucket.state_list("momentum_buffer"), steps]
        if bucket.grads_from_params:
            self.momentum = op_call("muon_momentum_", momentum_lists, bucket.params, 1)
        else:
            self.momentum = op_call("muon_momentum_", momentum_lists)

    def __call__(self, scalars: AmpScalars, **overrides: Any) -> None:
        bucket, group = self.bucket, self.bucket.group
        self.momentum(
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            inv_grad_scale=scalars.inv_grad_scale,
            found_inf=scalars.found_inf,
            clip_coef=scalars.clip_coef,
            write_unscaled_grads=overrides.get("write_unscaled_grads", group["write_unscaled_grads"]),
            momentum_buffer_scales=bucket.scales("momentum_buffer"),
            rounding_ids=bucket.param_ids,
            rounding_seed=group["seed"],
        )
        lr = lr_for_device(group["lr"], bucket.device)
        for shape, batch, update_params, ids in self.shapes:
            updates = batch.to(group["ns_dtype"])
            batch.copy_(orthogonalize(updates, group["ns_coefficients"], group["ns_steps"], group["eps"]))
            ratio = adjusted_lr_ratio(group["adjust_lr_fn"], shape)
            shape_lr = lr * ratio
            update_params(
                lr=0.0 if isinstance(shape_lr, Tensor) else shape_lr,
                lr_tensor=shape_lr if isinstance(shape_lr, Tensor) else None,
                momentum=0.0,
                dampening=0.0,
                weight_decay=group["weight_decay"] / ratio,
                nesterov=False,
                maximize=False,
                inv_grad_scale=None,
                found_inf=scalars.found_inf,
                clip_coef=None,
                write_unscaled_grads=False,
                momentum_buffer_scales=None,
                rounding_ids=ids,
                rounding_seed=group["seed"],
                stochastic_params=bucket.stochastic,
            )


def muon_param_groups(
    model: nn.Module,
    *,
    muon: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
    is_muon: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """The param groups of ``model`` for :class:`FusedMuon`: the hidden matrices in a Muon group
    (with the options ``muon``), every other param in an AdamW group (``use_muon=False``, with the
    options ``adamw``); params that do not require grad are left out, empty groups too.

    The rule (``is_muon(name, param)`` replaces it): the hidden matrices are the weights of the
    ``nn.Linear`` modules (``nn.MultiheadAttention``'s projections included: its ``in_proj_weight``
    too) except the model's last ``nn.Linear`` in module order (the output head) and any weight
    that is also an ``nn.Embedding``'s (tied). Everything else goes to AdamW: embeddings, the
    head, biases, norms, and 2-D params of other kinds (a learned position table), as Muon's
    authors prescribe.

    >>> groups = muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4, "betas": (0.9, 0.95)})
    >>> opt = fusedamp.FusedMuon(groups)
    """
    if is_muon is None:
        modules = list(model.modules())
        embedded = {id(p) for m in modules if isinstance(m, nn.Embedding) for p in m.parameters()}
        linears = [m for m in modules if isinstance(m, nn.Linear)]
        matrices = {id(m.weight) for m in linears[:-1]}
        matrices |= {
            id(m.in_proj_weight) for m in modules
            if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None
        }
        if linears:
            matrices.discard(id(linears[-1].weight))  # the head, even when a hidden layer shares it
        matrices -= embedded

        def is_muon(name: str, param: nn.Parameter) -> bool:
            return id(param) in matrices

    hidden: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (hidden if is_muon(name, param) else others).append(param)
    groups = []
    if hidden:
        groups.append({"params": hidden, "use_muon": True, **(muon or {})})
    if others:
        groups.append({"params": others, "use_muon": False, **(adamw or {})})
    return groups

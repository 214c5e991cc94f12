"""What FusedAdamW and FusedSGD share: master weights, grouping, AMP, clipping, state loading.

An optimizer step groups the params that have grads by (param group, device, param dtype,
grad dtype) and makes one fused op call per bucket. Everything the step needs from AMP (the
inverse loss scale, found_inf, the clip coefficient) stays on the device as 0-dim tensors: the
step never reads a tensor value on the host.

Params in any dense memory format are stepped in place (state is made in the param's format);
a param with gaps (a strided slice) is stepped through a contiguous copy written back after the
step, and a grad stored in another order than its param through a copy in the param's order.
Complex params are stepped as pairs of reals, as torch.optim does. float64 (and complex128)
buckets, which the fused kernels do not take, run torch's own ops (:meth:`_step_native`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal

import torch
from torch import Tensor

from fusedamp import _dtensor, ops
from fusedamp._layout import has_kernel, is_dense, like, real_view, same_order

__all__ = [
    "AmpScalars", "Bucket", "FusedOptimizer", "MasterWeights", "advance_steps", "check_lr",
    "join_bf16_remainder", "lr_for_device", "native_grads", "split_bf16_remainder", "torch_flags",
]

MasterWeights = bool | Literal["remainder"]

# The state entries holding the fp32 value of a half param; at most one is present.
MASTER_KEY = "master"
REMAINDER_KEY = "master_remainder"

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float32, *_HALF_DTYPES, torch.float64, torch.complex64, torch.complex128)

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does.
_CLIP_EPS = 1e-6


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


def _master_key(mode: MasterWeights, dtype: torch.dtype) -> str | None:
    if dtype not in _HALF_DTYPES or mode is False:
        return None
    return REMAINDER_KEY if mode == "remainder" else MASTER_KEY


def _state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a param's moments: float32 for float32/float16/bfloat16 params (the fused
    kernels' math), the param's own for float64 and complex params, as torch.optim keeps them."""
    return torch.float32 if param_dtype in (torch.float32, *_HALF_DTYPES) else param_dtype


def _on(tensor: Tensor | None, device: torch.device) -> Tensor | None:
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
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    write_backs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    grad_write_backs: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def state_list(self, key: str) -> list[Tensor]:
        if self.complex:
            return [real_view(state[key]) for state in self.states]
        return [state[key] for state in self.states]

    def masters(self) -> list[Tensor]:
        return [] if self.master_key is None else self.state_list(self.master_key)


@dataclass
class AmpScalars:
    """The device tensors that turn a plain step into an AMP step (None: not used)."""

    inv_grad_scale: Tensor | None
    found_inf: Tensor | None
    clip_coef: Tensor | None

    def writes_grads(self, write_unscaled_grads: bool) -> bool:
        """Whether a step writes the grads it used back (csrc/common/inputs.h step_writes_grad)."""
        return write_unscaled_grads and (self.inv_grad_scale is not None or self.clip_coef is not None)


def torch_flags(
    foreach: bool | None, fused: bool | None, capturable: bool, differentiable: bool
) -> dict[str, Any]:
    """torch.optim's implementation switches as defaults, accepted with torch's meaning for a
    drop-in constructor call: the step is always the fused one (on the device, capturable in
    CUDA graphs), whatever ``foreach``/``fused`` ask for. ``differentiable=True`` is refused
    by add_param_group."""
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    return {"foreach": foreach, "fused": fused, "capturable": capturable, "differentiable": differentiable}


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


def check_lr(lr: float | Tensor) -> None:
    """torch.optim's checks of a constructor's lr (a float, or a one-element tensor), NaN included."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


class FusedOptimizer(torch.optim.Optimizer, ABC):
    """Base of FusedAdamW and FusedSGD; subclasses define the state and the op call.

    Subclasses define ``_moment_keys`` and ``_step_bucket``; this class does the rest.

    >>> opt = fusedamp.FusedSGD(model.parameters(), lr=0.1)  # a FusedOptimizer
    """

    # torch.amp.GradScaler (and fusedamp.GradScaler) hand the scale and found_inf to step()
    # as the attributes grad_scale and found_inf instead of unscaling the grads first.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        max_grad_norm: float | None,
    ) -> None:
        if max_grad_norm is not None and not 0.0 < max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        super().__init__(params, defaults)
        self._check_hyperparameters()
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None
        # Set by _fusedamp_check_grads, used (once) by the step that follows it.
        self._pending_clip_coef: Tensor | None = None

    # --- construction and state -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mode = group["master_weights"]
        if mode not in (True, False, "remainder"):
            raise ValueError(
                f"Invalid master_weights value: {mode!r}; expected True (fp32 masters for half "
                "params), False (update half params directly) or 'remainder' (bf16 params only)"
            )
        name = type(self).__name__
        if group["differentiable"]:
            raise RuntimeError(
                f"{name} does not support differentiable=True: its fused step is not recorded by "
                f"autograd. Use torch.optim.{name.removeprefix('Fused')}(differentiable=True) to "
                "differentiate through optimizer steps."
            )
        for index, param in enumerate(group["params"]):
            where = f"param {index} of group {len(self.param_groups) - 1}"
            if param.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(
                    f"{name} supports float32, float16, bfloat16, float64, complex64 and "
                    f"complex128 params; {where} is {param.dtype}"
                )
            if param.layout != torch.strided:
                raise TypeError(f"{name} needs dense (strided) params; {where} has layout {param.layout}")
            if mode == "remainder" and param.dtype == torch.float16:
                raise ValueError(
                    f"master_weights='remainder' needs bfloat16 params; {where} is float16 "
                    "(use master_weights=True for float16 params)"
                )

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles (and deep-copies) only defaults, state and param_groups.
        return {**super().__getstate__(), "max_grad_norm": self.max_grad_norm}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("last_grad_norm", None)
        self.__dict__.setdefault("_pending_clip_coef", None)
        # Groups loaded from a torch.optim state_dict lack fusedamp's own options.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _check_hyperparameters(self) -> None:
        """Raises ValueError if a group holds a float option (lr, eps, betas, momentum, ...)
        that is NaN or infinite, which the ops refuse.

        step() checks every group before it updates any, so that a bad value in one group
        (set after construction, by hand or by a scheduler) leaves every param and state as
        it was instead of failing halfway through the step.
        """
        for index, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key == "params":
                    continue
                for item in value if isinstance(value, tuple) else (value,):
                    if isinstance(item, float) and not math.isfinite(item):
                        raise ValueError(
                            f"{type(self).__name__}: {key}={value!r} in param group {index}; it "
                            "must be finite"
                        )

    @abstractmethod
    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The fp32 state entries shaped like the param that ``group``'s options need."""

    @abstractmethod
    def _step_bucket(self, bucket: Bucket, scalars: AmpScalars) -> None:
        """One fused op call on ``bucket``, its state made by _state_of."""

    @abstractmethod
    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None:
        """The step of a bucket the fused kernels do not take (float64), with torch's ops."""

    def _new_state(self, key: str, param: Tensor, state: dict[str, Any]) -> Tensor:
        """A fresh state tensor for ``key`` shaped and laid out like ``param`` (the tensor the
        kernels step); ``state`` holds the entries made before it."""
        if key == "step":
            return torch.zeros((), dtype=torch.float32, device=param.device)
        return torch.zeros_like(param, dtype=_state_dtype(param.dtype))

    def _state_of(self, param: Tensor, bucket: Bucket, work_param: Tensor) -> dict[str, Any]:
        """The state of ``param``, made like ``work_param`` (a DTensor's local shard, or the
        dense copy of a param with gaps) where it is missing."""
        state = self.state[param]
        for key in bucket.state_keys:
            if key not in state:
                state[key] = self._new_state(key, work_param, state)
        master_key = bucket.master_key
        if (MASTER_KEY in state) != (master_key == MASTER_KEY) or (REMAINDER_KEY in state) != (
            master_key == REMAINDER_KEY
        ):
            _convert_master(work_param, state, master_key)
        return state

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 value the optimizer updates for ``param``.

        The fp32 master itself, a rebuilt copy in remainder mode, or ``param.float()`` when the
        param has no master (fp32 params, ``master_weights=False``, no step taken yet).
        """
        state = self.state.get(param, {})
        if MASTER_KEY in state:
            return state[MASTER_KEY]
        if REMAINDER_KEY in state:
            return join_bf16_remainder(param, state[REMAINDER_KEY])
        return param.detach().float()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of the matching ``torch.optim`` optimizer.

        State is copied (never aliased) onto each param's device and into its memory format:
        steps as float32, moments as float32 (float64 / complex params: their own dtype), fp32
        masters as float32, remainders as int16. Missing entries (masters of a torch.optim
        state_dict) are made from the params at the next step.
        """
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its param's dtype, which would round the
        # fp32 moments and masters of half params: redo the cast from the saved values.
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            state = self.state[param]
            local_param = _dtensor.local(param)
            for key, value in saved.items():
                if key == "step":
                    state[key] = torch.tensor(float(value), dtype=torch.float32, device=param.device)
                elif isinstance(value, Tensor):
                    dtype = torch.int16 if key == REMAINDER_KEY else _state_dtype(param.dtype)
                    if key == MASTER_KEY:
                        dtype = torch.float32
                    value = value.detach()
                    if value.shape == local_param.shape and is_dense(local_param):
                        state[key] = like(value, local_param, dtype)
                    else:  # a param with gaps is stepped through a contiguous copy
                        state[key] = value.to(
                            device=param.device, dtype=dtype, memory_format=torch.contiguous_format,
                            copy=True,
                        )

    # --- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step (one fused op call per device and dtype).

        When a GradScaler drives the step, its ``grad_scale`` and ``found_inf`` unscale the
        grads and skip the whole step on inf/NaN inside the kernel.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        self._check_hyperparameters()
        buckets = self._buckets()
        clip_coef, self._pending_clip_coef = self._pending_clip_coef, None
        if clip_coef is None and self.max_grad_norm is not None and buckets:
            _, sums = self._check_and_norm(inv_scale)
            clip_coef = self._clip_coef(sums)
        per_device: dict[torch.device, AmpScalars] = {}
        for bucket in buckets:
            scalars = per_device.get(bucket.device)
            if scalars is None:
                scalars = AmpScalars(
                    _on(inv_scale, bucket.device), _on(found_inf, bucket.device),
                    _on(clip_coef, bucket.device),
                )
                per_device[bucket.device] = scalars
            (self._step_native if bucket.native else self._step_bucket)(bucket, scalars)
            for original, work in bucket.write_backs:
                original.copy_(work)
            if scalars.writes_grads(bucket.group["write_unscaled_grads"]):
                for original, work in bucket.grad_write_backs:
                    original.copy_(work)
        return loss

    def _grads(self) -> Iterable[tuple[dict[str, Any], Tensor, Tensor]]:
        """(group, param, grad) for every param that has a grad."""
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                yield group, param, grad

    def _buckets(self) -> list[Bucket]:
        buckets: dict[tuple[int, torch.device, torch.dtype, torch.dtype], Bucket] = {}
        for group, param, grad in self._grads():
            key = (id(group), param.device, param.dtype, grad.dtype)
            bucket = buckets.get(key)
            if bucket is None:
                master_key = _master_key(group["master_weights"], param.dtype)
                state_keys = ("step", *self._moment_keys(group))
                bucket = buckets[key] = Bucket(
                    group, param.device, master_key, state_keys, native=not has_kernel(param.dtype),
                    complex=param.is_complex(),
                )
            # DTensor (FSDP2) params are updated through their local shards.
            work_param = _dtensor.local(param)
            work_grad = _dtensor.local(grad)
            # The common case, both contiguous, needs no further look at the layouts.
            if not (work_param.is_contiguous() and work_grad.is_contiguous()):
                work_param, work_grad = _kernel_layouts(bucket, work_param, work_grad)
            if bucket.complex:
                bucket.params.append(real_view(work_param))
                bucket.grads.append(real_view(work_grad))
            else:
                bucket.params.append(work_param)
                bucket.grads.append(work_grad)
            bucket.states.append(self._state_of(param, bucket, work_param))
        return list(buckets.values())

    # --- AMP: the read-only pass and clipping -------------------------------------------------

    def _fusedamp_check_grads(self, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        """The one read-only pass over the grads that fusedamp.GradScaler.step() runs.

        Returns a fresh float32 found_inf per device (> 0: some grad is inf/NaN). With
        ``max_grad_norm`` set, the same pass also takes the norm of the unscaled grads
        (``grad * inv_scale``), and the next step() clips with it instead of reading the
        grads again.
        """
        found, sums = self._check_and_norm(inv_scale)
        if self.max_grad_norm is not None and sums:
            self._pending_clip_coef = self._clip_coef(sums)
        return found

    def _check_and_norm(
        self, inv_scale: Tensor | None
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """found_inf and, with clipping on, the sum of squares of the unscaled grads per device.

        found_inf is this rank's (GradScaler combines the ranks'). The sums of DTensor grads
        are summed over the ranks of their meshes, so that the norm is the global norm; plain
        grads next to them count once, as replicated params do.
        """
        grads: dict[torch.device, list[Tensor]] = {}
        sharded: dict[torch.device, list[Tensor]] = {}
        for _, param, grad in self._grads():
            (sharded if _dtensor.is_dtensor(grad) else grads).setdefault(param.device, []).append(grad)
        found: dict[torch.device, Tensor] = {}
        sums: dict[torch.device, Tensor] = {}
        for device in [*grads, *(device for device in sharded if device not in grads)]:
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
            if self.max_grad_norm is not None:
                sums[device] = torch.zeros((), dtype=torch.float32, device=device)
            device_inv_scale = _on(inv_scale, device)
            if device in sharded:
                sharded_sum = None
                if self.max_grad_norm is not None:
                    sharded_sum = torch.zeros((), dtype=torch.float32, device=device)
                local_grads = [_dtensor.local(grad) for grad in sharded[device]]
                ops.check_and_norm_(local_grads, found[device], sharded_sum, device_inv_scale)
                if sharded_sum is not None:
                    _dtensor.all_reduce_sum_(sharded_sum, _dtensor.meshes_of(sharded[device]))
                    sums[device] += sharded_sum
            if device in grads:
                ops.check_and_norm_(grads[device], found[device], sums.get(device), device_inv_scale)
        return found, sums

    def _clip_coef(self, sums: dict[torch.device, Tensor]) -> Tensor:
        """min(1, max_grad_norm / (norm + 1e-6)) on the first grad's device; sets last_grad_norm."""
        assert self.max_grad_norm is not None
        devices = list(sums)
        total = sums[devices[0]].clone()
        for device in devices[1:]:
            total += _on(sums[device], devices[0])
        self.last_grad_norm = total.sqrt_()
        return (self.max_grad_norm / (self.last_grad_norm + _CLIP_EPS)).clamp_(max=1.0)


def _kernel_layouts(bucket: Bucket, param: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The param and grad the kernels walk side by side: the param itself when it is dense
    (else a contiguous copy, written back after the step), the grad itself when it is dense in
    the param's element order (else a copy in that order, written back when the step writes
    grads). Records the write-backs in ``bucket``."""
    if not is_dense(param):
        work_param = param.detach().contiguous()
        bucket.write_backs.append((param, work_param))
        param = work_param
    if not (is_dense(grad) and same_order(grad, param)):
        work_grad = like(grad, param)
        bucket.grad_write_backs.append((grad, work_grad))
        grad = work_grad
    return param, grad


def _convert_master(param: Tensor, state: dict[str, Any], master_key: str | None) -> None:
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

"""The base class of FusedAdamW, FusedSGD and FusedMuon: construction, grouping into buckets, the step.

An optimizer step groups the params that have grads by (param group, device, param dtype,
grad dtype) and makes one fused op call per bucket. Everything the step needs from AMP (the
inverse loss scale, found_inf, the clip coefficient) stays on the device as 0-dim tensors: the
step never reads a tensor value on the host.

Params in any dense memory format are stepped in place (state is made in the param's format);
a param with gaps (a strided slice) is stepped through a contiguous copy written back after the
step, and a grad stored in another order than its param through a copy in the param's order.
Complex params are stepped as pairs of reals, as torch.optim does. float64 (and complex128)
buckets, which the fused kernels do not take, run torch's own ops (:meth:`_step_native`).

step() computes the AMP scalars once and hands the buckets to an executor (_executor.py): stepped
in place, or with ``offload="cpu"`` on the host (fusedamp.optim.offload), where the state lives and
the same buckets run on host copies of the params and grads.

The state methods (made, converted, exported, loaded) live in _state.py, master weights in
_masters.py, the per-bucket step pieces in _step.py, the read-only pass and clipping in
_clipping.py.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from fusedamp import _dtensor
from fusedamp._layout import has_kernel
from fusedamp.optim import _codecs
from fusedamp.optim._clipping import check_and_norm, clip_coefficient
from fusedamp.optim._executor import Executor
from fusedamp.optim._masters import HALF_DTYPES
from fusedamp.optim._plan import StepPlan, op_call
from fusedamp.optim._state import OptimizerState
from fusedamp.optim._step import AmpScalars, Bucket
from fusedamp.optim.offload import OffloadExecutor, OffloadOptions

__all__ = ["FusedOptimizer", "check_lr", "torch_flags"]

_SUPPORTED_DTYPES = (torch.float32, *HALF_DTYPES, torch.float64, torch.complex64, torch.complex128)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_HALF_PAIR = set(HALF_DTYPES)  # fp16 and bf16: a param and grad pair without kernels
# Tensor types that are never a DTensor: the step takes them as they are.
_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})


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


def check_lr(lr: float | Tensor) -> None:
    """torch.optim's checks of a constructor's lr (a float, or a one-element tensor), NaN included."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


class FusedOptimizer(OptimizerState, ABC):
    """Base of FusedAdamW and FusedSGD; subclasses define the state and the op call.

    Subclasses define ``_moment_keys``, the op of a step (``_op``, ``_op_lists``,
    ``_op_keywords``, ``_call_options``) and ``_step_native``; this class does the rest.

    >>> opt = fusedamp.FusedSGD(model.parameters(), lr=0.1)  # a FusedOptimizer
    """

    # The torch.ops.fusedamp op of a bucket's step; its first two lists are params and grads.
    _op: str
    # The group options that _op_keywords reads at each call: changing them keeps the step plan.
    _call_options: frozenset[str] = frozenset()
    # The group options that are floats (or tuples of floats), checked at every step.
    _float_options: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        max_grad_norm: float | None,
        offload: OffloadOptions | None = None,
    ) -> None:
        """``offload``: the checked offload keywords (OffloadOptions.checked), None without offload."""
        if max_grad_norm is not None and not 0.0 < max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        # Where the buckets are stepped (_executor.py): in place; offloaded once the groups exist.
        self._executor: Executor = Executor(self)
        super().__init__(params, defaults)
        self._check_hyperparameters()
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None
        # Set by _fusedamp_check_grads, used (once) by the step that follows it.
        self._pending_clip_coef: Tensor | None = None
        self._plan: StepPlan | None = None  # the buckets of the last step (_plan.py)
        # The plan a GradScaler's read-only pass found fitting, trusted by the step() it runs
        # right after without checking it again (fusedamp.GradScaler.step clears it).
        self._checked_plan: StepPlan | None = None
        if offload is not None:
            self._executor = OffloadExecutor(self, offload)

    # Whether sparse grads are taken (torch.optim.SGD takes them, AdamW refuses them).
    _takes_sparse_grads = False

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether a GradScaler may leave the unscaling and the inf skip to step().

        torch.amp.GradScaler (and fusedamp.GradScaler) then hand the scale and found_inf to
        step() as the attributes grad_scale and found_inf instead of unscaling the grads first;
        grads a scaler.unscale_() already unscaled (to clip them) step with found_inf alone.
        Lightning and Fabric read this flag to refuse gradient clipping (and not unscale before
        it), right for torch's fused optimizers but not here: to their code it reads False, so
        they unscale, clip and call scaler.step(), whose found_inf still skips in the kernel
        without a host sync. Assigning a bool makes that the answer for every caller (False:
        the scaler syncs and calls step() only on clean steps, which accelerate needs to see a
        skipped step).
        """
        forced = self.__dict__.get("_fusedamp_amp_scaling")
        if forced is not None:
            return forced
        if torch.compiler.is_compiling():  # a compiled scaler.step(); dynamo cannot trace frames
            return True
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return not caller.startswith(("lightning.", "lightning_fabric.", "pytorch_lightning."))

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_fusedamp_amp_scaling"] = bool(value)

    # --- construction and state -------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plan = self._checked_plan = None
        group = self.param_groups[-1]
        mode = group["master_weights"]
        if mode not in (True, False, "remainder", "stochastic"):
            raise ValueError(
                f"Invalid master_weights value: {mode!r}; expected True (fp32 masters for half "
                "params), False (update half params directly), 'remainder' (bf16 params only) or "
                "'stochastic' (no master: the update is rounded into half params stochastically)"
            )
        _codecs.check_moments(group["moments"])
        if not isinstance(group["seed"], int):
            raise TypeError(f"seed must be an int, got {type(group['seed']).__name__}")
        self._index_params()
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
            if group["moments"] != "fp32" and not has_kernel(param.dtype) or (
                group["moments"] != "fp32" and param.is_complex()
            ):
                raise TypeError(
                    f"moments={group['moments']!r} is for float32, float16 and bfloat16 params; "
                    f"{where} is {param.dtype}, whose step runs torch's own ops with moments in its "
                    "dtype: put it in a param group with moments='fp32'"
                )
            if mode == "remainder" and param.dtype == torch.float16:
                raise ValueError(
                    f"master_weights='remainder' needs bfloat16 params; {where} is float16 "
                    "(use master_weights=True for float16 params)"
                )
        self._executor.add_params(group["params"], group)


    def __getstate__(self) -> dict[str, Any]:
        self._executor.check_picklable(type(self).__name__)
        # torch.optim pickles (and deep-copies) only defaults, state and param_groups.
        return {**super().__getstate__(), "max_grad_norm": self.max_grad_norm}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_executor" not in self.__dict__:  # unpickled
            self._executor = Executor(self)
        self.__dict__.setdefault("last_grad_norm", None)
        self.__dict__.setdefault("_pending_clip_coef", None)
        self._plan = self._checked_plan = None
        # Groups loaded from a torch.optim state_dict lack fusedamp's own options.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._index_params()

    def _check_hyperparameters(self) -> None:
        """Raises ValueError if a group holds a float option (lr, eps, betas, momentum, ...)
        that is NaN, infinite or beyond float32's range, which the ops refuse or overflow on
        (subclasses add the rules of their own options).

        step() checks every group before it updates any, so that a bad value in one group
        (set after construction, by hand or by a scheduler) leaves every param and state as
        it was instead of failing halfway through the step.
        """
        # Only the numeric options (a group may carry the user's own keys): this runs at every
        # step, and a loop over every option cost a tenth of a small model's FusedSGD step.
        for index, group in enumerate(self.param_groups):
            for key in self._float_options:
                value = group.get(key)
                for item in value if type(value) is tuple else (value,):
                    if isinstance(item, float) and not abs(item) <= _FLOAT32_MAX:
                        raise ValueError(
                            f"{type(self).__name__}: {key}={value!r} in param group {index}; it "
                            "must be finite and within float32's range (the kernels' math)"
                        )

    @abstractmethod
    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The fp32 state entries shaped like the param that ``group``'s options need."""

    @abstractmethod
    def _op_lists(self, bucket: Bucket) -> list[list[Tensor]]:
        """The tensor lists of ``_op`` for ``bucket`` (params, grads, then its state's), made
        once per bucket."""

    @abstractmethod
    def _op_keywords(self, bucket: Bucket, scalars: AmpScalars) -> dict[str, Any]:
        """The other arguments of ``_op`` for ``bucket``, by name, read at each step."""

    def _step_bucket(self, bucket: Bucket, scalars: AmpScalars, **overrides: Any) -> None:
        """One fused op call on ``bucket``, its state made by _state_of; ``overrides`` replace
        keywords of _op_keywords (an offloaded step writes no grads)."""
        if bucket.call is None:
            if bucket.grads_from_params:
                bucket.call = op_call(self._op, self._op_lists(bucket), bucket.params, 1)
            else:
                bucket.call = op_call(self._op, self._op_lists(bucket))
        bucket.call(**{**self._op_keywords(bucket, scalars), **overrides})

    @abstractmethod
    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None:
        """The step of a bucket the fused kernels do not take (float64), with torch's ops."""

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
        found_inf: Tensor | float | None = getattr(self, "found_inf", None)
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        self._check_hyperparameters()
        executor = self._executor
        work = executor.prepare(found_inf, scaled=grad_scale is not None)
        # torch.amp.GradScaler's found_inf of no grads at all is the number 0.
        found_inf = found_inf if isinstance(found_inf, Tensor) else None
        clip_coef, self._pending_clip_coef = self._pending_clip_coef, None
        if clip_coef is None and self.max_grad_norm is not None and work:
            _, sums = executor.check_and_norm(inv_scale, with_norm=True)
            clip_coef = self._clip_coef(sums)
        executor.run(work, AmpScalars(inv_scale, found_inf, clip_coef))
        return loss

    def _run_bucket(self, bucket: Bucket, scalars: AmpScalars, write_grads: bool = True) -> None:
        """Steps ``bucket`` with ``scalars`` (on its device) and writes back what it stepped through
        copies; ``write_grads=False``: the step writes no grads (an offloaded step's host grads)."""
        if bucket.native:
            self._step_native(bucket, scalars)
        elif write_grads:
            self._step_bucket(bucket, scalars)
        else:
            self._step_bucket(bucket, scalars, write_unscaled_grads=False)
        for original, work in bucket.write_backs:
            original.copy_(work)
        if write_grads and scalars.writes_grads(bucket.group["write_unscaled_grads"]):
            for original, work in bucket.grad_write_backs:
                original.copy_(work)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's zero_grad; offloaded, the host grad buffers follow (docs/offload.md)."""
        self._executor.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)
        self._executor.after_zero_grad(set_to_none)

    def offload_no_sync(self) -> AbstractContextManager[None]:
        """A context in which backward leaves the grads on the params' device, where they add up:
        for the micro-batches of gradient accumulation before the last, whose backward sends the
        sums to the host. Without it every backward sends its grads and the last copy wins; with
        ``offload_gradients`` or ``step_in_backward`` it is required. A no-op without offload
        (docs/offload.md).

        >>> for i, batch in enumerate(micro_batches):
        ...     with opt.offload_no_sync() if i < len(micro_batches) - 1 else nullcontext():
        ...         loss_fn(model(batch)).backward()
        >>> opt.step()
        """
        return self._executor.no_sync()

    def offload_flush(self) -> None:
        """With ``offload_delay=1``: waits for the delayed step and copies its update into the
        params, so that the next forward (an evaluation, a saved model) sees every update; the
        training after it goes on delayed. A no-op otherwise (docs/offload.md).

        >>> opt.offload_flush()
        >>> torch.save(model.state_dict(), "model.pt")  # with the last step's update
        """
        self._executor.flush()

    def _grads(self) -> Iterable[tuple[dict[str, Any], Tensor, Tensor]]:
        """(group, param, grad) for every param that has a grad."""
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None:
                    yield group, param, self._dense_grad(param, grad)

    def _dense_grad(self, param: Tensor, grad: Tensor) -> Tensor:
        """``grad`` as the step takes it: a sparse grad as the dense one it stands for (where the
        optimizer takes sparse grads); refused when its shape is not its param's."""
        if grad.is_sparse:
            if not self._takes_sparse_grads:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            # Stepped as the dense grad it stands for (duplicate indices summed), which
            # is what torch's SGD adds: slower, the same result; .grad stays as it is.
            grad = grad.to_dense()
        if grad.shape != param.shape:
            raise RuntimeError(
                f"{type(self).__name__}: a grad of shape {tuple(grad.shape)} for a param of "
                f"shape {tuple(param.shape)}; each grad must have its param's shape"
            )
        return grad

    def _buckets_of_step(self) -> list[Bucket]:
        """The buckets step() updates in place: the step plan's, trusted without a check when the
        read-only pass just found it fitting (see _checked_plan)."""
        checked, self._checked_plan = self._checked_plan, None
        return self._planned_buckets(checked)

    def _planned_buckets(self, checked: StepPlan | None = None) -> list[Bucket]:
        """The buckets of this step: the step plan's while it fits (see _plan.py; `checked`: a
        plan found fitting by the read-only pass just before), else new ones (and their plan)."""
        if torch.compiler.is_compiling():
            return self._buckets()
        plan = self._plan
        if plan is not None and (plan is checked or plan.fits(self)):
            return plan.buckets
        buckets = self._buckets()
        self._plan = StepPlan.build(self, buckets)
        return buckets

    def _buckets(
        self, host_copies: Iterable[tuple[dict[str, Any], Tensor, Tensor, Tensor]] | None = None
    ) -> list[Bucket]:
        """The buckets of every param with a grad, each stepped where it is; or, given
        ``host_copies`` (group, param, host copy, host grad) of an offloaded step, of those host
        copies, with the state of their params (made like the host copies)."""
        # Runs for every param at every step: the plain case takes the fewest Python steps.
        buckets: dict[tuple[int, torch.device, torch.dtype, torch.dtype], Bucket] = {}
        if host_copies is None:
            host_copies = ((group, param, param, grad) for group, param, grad in self._grads())
        for group, param, work_param, work_grad in host_copies:
            # fp16 params with bf16 grads (or the reverse), which the kernels do not pair: through
            # an fp32 copy of the grads (Bucket.add).
            grad_dtype = work_grad.dtype
            cross_half = grad_dtype != work_param.dtype and {grad_dtype, work_param.dtype} == _HALF_PAIR
            grad_dtype = torch.float32 if cross_half else grad_dtype
            key = (id(group), work_param.device, work_param.dtype, grad_dtype)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket.of(group, work_param, self._moment_keys(group), grad_dtype)
            if type(work_param) not in _PLAIN_TENSORS or type(work_grad) not in _PLAIN_TENSORS:
                # DTensor (FSDP2) params are updated through their local shards.
                work_param = _dtensor.local(work_param)
                work_grad = _dtensor.local(work_grad)
            work_param = bucket.add(work_param, work_grad)
            bucket.states.append(self._state_of(param, bucket, work_param))
            bucket.param_ids.append(self._param_index(param))
        return list(buckets.values())

    # --- AMP: the read-only pass and clipping -------------------------------------------------

    def _fusedamp_check_grads(self, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        """The one read-only pass over the grads that fusedamp.GradScaler.step() runs.

        Returns a fresh float32 found_inf per device (not 0: some grad is inf/NaN). With
        ``max_grad_norm`` set, the same pass also takes the norm of the unscaled grads
        (``grad * inv_scale``), and the next step() clips with it instead of reading the
        grads again.
        """
        with_norm = self.max_grad_norm is not None
        found, sums = self._executor.check_and_norm(inv_scale, with_norm, remember_plan=True)
        if self.max_grad_norm is not None and sums:
            self._pending_clip_coef = self._clip_coef(sums)
        return found

    def _fusedamp_plain_grads(self) -> bool:
        """Whether every grad is known to be a plain tensor (no DTensor): true while the step
        plan fits. fusedamp.GradScaler then skips its look for device meshes."""
        plan = self._plan
        if plan is None or torch.compiler.is_compiling():
            return False
        return plan is self._checked_plan or plan.fits(self)

    def _check_and_norm(
        self, inv_scale: Tensor | None, with_norm: bool, remember_plan: bool = False
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """found_inf (and ``with_norm`` the squared-norm sums) per device; `remember_plan`: a step
        plan found fitting is trusted by the next step() (see _checked_plan)."""
        if self._fusedamp_plain_grads():
            if remember_plan:
                self._checked_plan = self._plan
            return self._plan.check_and_norm(inv_scale, with_norm)
        grads = ((grad, param.device) for _, param, grad in self._grads())
        return check_and_norm(grads, inv_scale, with_norm)

    def _clip_coef(self, sums: dict[torch.device, Tensor]) -> Tensor:
        """The clip coefficient of ``sums`` (see clip_coefficient); sets last_grad_norm."""
        assert self.max_grad_norm is not None
        coef, self.last_grad_norm = clip_coefficient(sums, self.max_grad_norm)
        return coef

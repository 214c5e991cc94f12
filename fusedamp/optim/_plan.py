"""The step plan of a FusedOptimizer: the buckets of the last step with their op calls prepared,
reused while nothing they were built from has changed, so that a step over many small params
costs a check of each param instead of bucketing it again.

A plan is kept only when every bucket hands the user's own tensors to the kernels (plain,
dense params and grads of a kernel dtype; no complex views, no copies written back). It is
rebuilt when the optimizer's state dict, its param groups (a group added, a param list
changed, a param replaced in it), a group option the buckets depend on (anything but the
options the op reads at each call), a param's grad appearing or disappearing or changing its
dtype, shape or layout, a param's dtype or layout (``param.data = ...``), or a state entry a
bucket holds changes. The grads themselves are read at each step: backward makes new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from fusedamp import _C
from fusedamp._layout import KERNEL_DTYPES
from fusedamp.optim._step import Bucket, on_device


class PlannedOptimizer(Protocol):
    """What a plan reads of its optimizer (a ``fusedamp.optim._base.FusedOptimizer``)."""

    state: Any
    param_groups: list[dict[str, Any]]
    _call_options: frozenset[str]

    def _moment_keys(self, group: dict[str, Any]) -> tuple[str, ...]: ...

# Tensor types that are never a DTensor: the plan takes them as they are.
PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})


def op_call(
    op: str, lists: list[list[Tensor]], grads_of: list[Tensor] | None = None, grads_at: int = -1
) -> Callable[..., None]:
    """``torch.ops.fusedamp.<op>`` with its leading tensor lists bound, called with keywords.

    Eagerly a PreparedCall (the lists converted once; the list at ``grads_at`` read from the
    grads of ``grads_of`` at each call); while torch.compile traces, the op itself.
    """
    if torch.compiler.is_compiling():
        return partial(getattr(torch.ops.fusedamp, op), *lists)
    return _C.PreparedCall(f"fusedamp::{op}", lists, grads_of or [], grads_at)


def _same(a: Any, b: Any) -> bool:
    # Group options compared without a tensor's elementwise ==.
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    return type(a) is type(b) and a == b


def group_signature(optimizer: PlannedOptimizer, group: dict[str, Any]) -> tuple[Any, ...]:
    """What the buckets of ``group`` depend on: its state keys and every option that the op does
    not read at each call (``optimizer._call_options``)."""
    live = optimizer._call_options
    keys = tuple(key for key in group if key != "params" and key not in live)
    return optimizer._moment_keys(group), keys, [group[key] for key in keys]


def same_signature(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[0] == b[0] and a[1] == b[1] and all(map(_same, a[2], b[2]))


class BuiltFrom:
    """What a plan's buckets were built from besides the grads: the optimizer's state dict and the
    state dicts the buckets hold, its param groups, each group's param list and signature.

    >>> built_from = BuiltFrom(opt, [state for bucket in buckets for state in bucket.states])
    >>> built_from.unchanged(opt)
    True
    """

    def __init__(self, optimizer: PlannedOptimizer, states: list[dict[str, Any]]) -> None:
        self.state = optimizer.state
        self.groups = [
            (group, group["params"], group_signature(optimizer, group)) for group in optimizer.param_groups
        ]
        self.same_objects = _C.IdentityWatch(
            [self.state, *states], [group_params for _, group_params, _ in self.groups]
        )

    @staticmethod
    def plannable(optimizer: PlannedOptimizer) -> bool:
        """Whether a plan can watch the groups: each one's params are a list."""
        return all(type(group["params"]) is list for group in optimizer.param_groups)

    def unchanged(self, optimizer: PlannedOptimizer) -> bool:
        if optimizer.state is not self.state or len(optimizer.param_groups) != len(self.groups):
            return False
        for group, (planned, params, signature) in zip(optimizer.param_groups, self.groups, strict=True):
            if group is not planned or group["params"] is not params:
                return False
            if not same_signature(group_signature(optimizer, group), signature):
                return False
        return self.same_objects.unchanged()


class StepPlan:
    """The buckets of one step and what they were built from; see the module docstring.

    >>> plan = StepPlan.build(opt, opt._buckets())  # None when a bucket is not plain
    >>> plan.fits(opt)
    True
    """

    def __init__(self, optimizer: PlannedOptimizer, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        # Which params have a state (and which dict), every entry of those dicts, and the params
        # of each group.
        self.built_from = BuiltFrom(optimizer, [state for bucket in buckets for state in bucket.states])
        params = [param for _, group_params, _ in self.built_from.groups for param in group_params]
        self.watch = _C.GradWatch(params, [param.grad for param in params])
        # The read-only pass takes the grads in _grads()'s order, as without a plan.
        grads_by_device: dict[torch.device, list[Tensor]] = {}
        for param in params:
            if param.grad is not None:
                grads_by_device.setdefault(param.device, []).append(param)
        self.check_calls = {
            device: op_call("check_and_norm_", [[]], params_of_grads, 0)
            for device, params_of_grads in grads_by_device.items()
        }
        for bucket in buckets:
            # The op calls read the grads of the params at each step; these are last step's.
            bucket.grads = []
            bucket.grads_from_params = True

    @classmethod
    def build(cls, optimizer: PlannedOptimizer, buckets: list[Bucket]) -> StepPlan | None:
        """The plan of ``buckets`` (just made by ``optimizer._buckets()``), or None when some
        bucket steps copies or views of the user's tensors, which are made anew each step (or a
        group's params are not a list, which the plan watches)."""
        if not BuiltFrom.plannable(optimizer):
            return None
        for bucket in buckets:
            if bucket.native or bucket.complex or bucket.write_backs or bucket.grad_write_backs:
                return None
            for param, grad in zip(bucket.params, bucket.grads, strict=True):
                if type(param) not in PLAIN_TENSORS or type(grad) not in PLAIN_TENSORS:
                    return None
                if param.grad is not grad or grad.dtype not in KERNEL_DTYPES:
                    return None
        return cls(optimizer, buckets)

    def fits(self, optimizer: PlannedOptimizer) -> bool:
        """Whether the buckets are still those ``optimizer._buckets()`` would make now."""
        return self.built_from.unchanged(optimizer) and self.watch.fits()

    def check_and_norm(
        self, inv_scale: Tensor | None, with_norm: bool
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """_clipping.check_and_norm over the plan's grads (all plain, of kernel dtypes)."""
        found: dict[torch.device, Tensor] = {}
        sums: dict[torch.device, Tensor] = {}
        for device, call in self.check_calls.items():
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
            sum_of_squares = None
            if with_norm:
                sum_of_squares = sums[device] = torch.zeros((), dtype=torch.float32, device=device)
            call(
                found_inf=found[device], sum_of_squares=sum_of_squares, inv_scale=on_device(inv_scale, device)
            )
        return found, sums

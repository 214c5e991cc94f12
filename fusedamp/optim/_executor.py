"""Where and when a FusedOptimizer's buckets are stepped: the seam between ``step()`` and the
places a step can run.

``FusedOptimizer.step()`` computes what every step needs once (the inverse loss scale, found_inf,
the clip coefficient: the AMP scalars) and hands its buckets to an executor. :class:`Executor` steps
them where the params are, in place; ``fusedamp.optim.offload.OffloadExecutor`` steps them on the
host (staging the grads, chunks, copies back, the delayed update). Everything else an optimizer
does differently when offloaded (zero_grad, state_dict, master_of, ...) goes through the same
object, so the optimizers themselves hold no offload code.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor

from fusedamp import _dtensor
from fusedamp.optim._plan import PlannedOptimizer
from fusedamp.optim._step import AmpScalars, Bucket, on_device


class Stepper(PlannedOptimizer, Protocol):
    """What an executor calls on its optimizer (a ``fusedamp.optim._base.FusedOptimizer``): its
    groups, state and clipping option, and the bucket machinery an executor hands work to."""

    max_grad_norm: float | None

    def _buckets_of_step(self) -> list[Bucket]: ...

    def _buckets(self, entries: Iterable[tuple[dict[str, Any], Tensor, Tensor, Tensor]]) -> list[Bucket]: ...

    def _run_bucket(self, bucket: Bucket, scalars: AmpScalars, write_grads: bool = True) -> None: ...

    def _dense_grad(self, param: Tensor, grad: Tensor) -> Tensor: ...

    def _check_hyperparameters(self) -> None: ...

    def _check_and_norm(
        self, inv_scale: Tensor | None, with_norm: bool, remember_plan: bool = False
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]: ...


class Executor:
    """Steps an optimizer's buckets in place, on the params' devices (the base of the offloaded
    executor, whose other methods are no-ops here).

    >>> executor = Executor(opt)
    >>> work = executor.prepare(found_inf=None, scaled=False)  # the buckets of this step
    >>> executor.run(work, AmpScalars(None, None, None))
    """

    def __init__(self, optimizer: Stepper) -> None:
        # A weak reference: the optimizer owns its executor.
        self._optimizer = weakref.ref(optimizer)

    @property
    def optimizer(self) -> Stepper:
        optimizer = self._optimizer()
        assert optimizer is not None, "the optimizer was dropped"
        return optimizer

    @property
    def dropped(self) -> bool:
        return self._optimizer() is None

    # --- the step ------------------------------------------------------------------------------

    def prepare(self, found_inf: Tensor | float | None, scaled: bool) -> list[Any]:
        """What this step updates (empty: nothing has a grad), made ready; ``found_inf`` and
        ``scaled`` (a GradScaler handed over its scale) as step() got them."""
        return self.optimizer._buckets_of_step()

    def check_and_norm(
        self, inv_scale: Tensor | None, with_norm: bool, remember_plan: bool = False
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """The read-only pass over the grads: found_inf and (``with_norm``) the sums of squares of
        the unscaled grads per device (see FusedOptimizer._check_and_norm)."""
        return self.optimizer._check_and_norm(inv_scale, with_norm, remember_plan)

    def run(self, work: list[Any], scalars: AmpScalars) -> None:
        """Steps ``work`` (what prepare() returned) with ``scalars``."""
        optimizer = self.optimizer
        per_device: dict[torch.device, AmpScalars] = {}
        bucket: Bucket
        for bucket in work:
            device_scalars = per_device.get(bucket.device)
            if device_scalars is None:
                device_scalars = per_device[bucket.device] = AmpScalars(
                    on_device(scalars.inv_grad_scale, bucket.device),
                    on_device(scalars.found_inf, bucket.device),
                    on_device(scalars.clip_coef, bucket.device),
                )
            optimizer._run_bucket(bucket, device_scalars)

    # --- what an offloaded optimizer does differently ------------------------------------------

    def add_params(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The params of a group just added (or made at construction)."""

    def drain(self) -> None:
        """Waits for the steps still running in the background (and raises their errors)."""

    def flush(self) -> None:
        """Makes the params current: the next forward sees every update (FusedOptimizer.offload_flush)."""

    def no_sync(self) -> AbstractContextManager[None]:
        """See FusedOptimizer.offload_no_sync."""
        return nullcontext()

    def before_zero_grad(self, set_to_none: bool) -> None:
        """Before torch's zero_grad drops or zeroes the params' grads."""

    def after_zero_grad(self, set_to_none: bool) -> None:
        """After torch's zero_grad."""

    def stepped(self, param: Tensor) -> Tensor:
        """The tensor the step updates for ``param`` (its value without a master)."""
        return param

    def state_like(self, param: Tensor) -> Tensor:
        """The tensor whose device and layout the state of ``param`` takes."""
        return _dtensor.local(param)

    def delayed_params(self) -> dict[int, Tensor]:
        """The updates made but not yet in their params, by id of the param (offload_delay)."""
        return {}

    def load_delayed(self, param: Tensor, value: Tensor) -> None:
        """A checkpoint's update not yet in ``param`` when it was saved (offload_delay): without a
        delay it is applied now, so that the next forward sees it."""
        with torch.no_grad():
            param.copy_(value)

    def after_load(self) -> None:
        """After load_state_dict made the new param groups and state."""

    def buffer_bytes(self, state_bytes: int) -> dict[str, int]:
        """state_bytes()'s entries beyond the state (see FusedOptimizer.state_bytes)."""
        return {}

    def check_picklable(self, name: str) -> None:
        """Raises TypeError when the optimizer holds what pickle cannot take."""

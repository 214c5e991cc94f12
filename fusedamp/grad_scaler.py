"""Dynamic loss scaling, drop-in for ``torch.amp.GradScaler``, on fusedamp's fused kernels."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from fusedamp import _dtensor, ops

__all__ = ["GradScaler", "OptState"]


def _fresh_optimizer_state() -> dict[str, Any]:
    # A module-level factory (not a lambda) keeps the per-optimizer defaultdict picklable.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class GradScaler(torch.amp.GradScaler):
    """Scales the loss so that fp16/bf16 gradients neither underflow nor overflow, and skips
    the optimizer steps whose gradients hold inf/NaN; same API and errors as
    ``torch.amp.GradScaler``, and an instance of it (for the clients that check, with the
    private helpers they call, such as accelerate's ``_lazy_init_scale_growth_tracker``).

    Beyond torch:

    * fp16 and bf16 gradients are unscaled on every device (torch refuses fp16);
    * with an optimizer that declares ``_step_supports_amp_scaling`` (``fusedamp.FusedAdamW``,
      ``torch.optim.AdamW(fused=True)``, ...) ``scale``, ``step`` and ``update`` never wait for
      the device: the grads are checked read-only, the optimizer unscales and skips in its kernel;
    * :attr:`step_skipped` tells, as a device tensor, whether this iteration's step was skipped;
    * ``hysteresis`` (overflows tolerated before backing off), ``min_scale`` and ``max_scale``.
      Their defaults give exactly torch's rule, and then :meth:`state_dict` is torch's too.

    Example::

        scaler = fusedamp.GradScaler("cuda")
        skipped = torch.zeros((), dtype=torch.int64, device="cuda")
        for step, (inputs, target) in enumerate(loader):
            optimizer.zero_grad()
            with fusedamp.autocast("cuda"):
                loss = loss_fn(model(inputs), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            skipped += scaler.step_skipped  # stays on the device: no sync
            scaler.update()
            if step % 100 == 0:  # one sync per log line, not one per step
                print(f"step {step}: scale {scaler.get_scale()}, {skipped.item()} skipped")

    The same counter keeps a schedule in step with the updates really applied, without a
    sync: ``applied = step + 1 - skipped`` is a device tensor that can drive a tensor ``lr``.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float = 0.0,
        max_scale: float = math.inf,
    ) -> None:
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(
                "fusedamp.GradScaler is enabled, but CUDA is not available.  Disabling.", stacklevel=2
            )
            self._enabled = False
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
            if growth_interval < 1:
                raise ValueError(f"growth_interval must be a positive int, got {growth_interval}")
            if hysteresis < 1:
                raise ValueError(f"hysteresis must be a positive int, got {hysteresis}")
            if not 0.0 <= min_scale <= max_scale:
                raise ValueError(f"need 0 <= min_scale <= max_scale, got {min_scale} and {max_scale}")
        self._init_scale = init_scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        # The device state is created by the first scale(), on the device of the loss.
        self._scale: Tensor | None = None
        self._growth_tracker: Tensor | None = None
        self._hysteresis_tracker: Tensor | None = None
        self._last_found_inf: Tensor | None = None
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
        """Multiplies a tensor, or every tensor of a (nested) list, tuple or iterable, by the
        current scale; returns ``outputs`` unchanged when disabled."""
        if not self._enabled:
            return outputs
        scale_on: dict[torch.device, Tensor] = {}

        def apply(value: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
            if isinstance(value, Tensor):
                if self._scale is None:
                    self._create_device_state(value.device)
                if value.device not in scale_on:
                    scale_on[value.device] = self._scale.to(value.device, non_blocking=True)
                return value * scale_on[value.device]
            if isinstance(value, Iterable):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place and records whether any was
        inf/NaN; optional, for working on unscaled gradients (clipping) before :meth:`step`.

        Call it at most once per optimizer per iteration, after every backward of that iteration.
        Sparse fp16 gradients are coalesced first, replacing ``.grad``.
        """
        if not self._enabled:
            return
        self._check_device_state("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._inv_scale()
        found_inf_per_device = {}
        for device, grads in _grads_by_device(optimizer).items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            ops.unscale_(grads, found_inf, inv_scale.to(device, non_blocking=True))
            found_inf_per_device[device] = found_inf
        _combine_ranks(found_inf_per_device, optimizer)
        state["found_inf_per_device"] = found_inf_per_device
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales the gradients unless :meth:`unscale_` already did, then runs
        ``optimizer.step(*args, **kwargs)`` unless they hold inf/NaN; returns what it returns.

        An optimizer with ``_step_supports_amp_scaling`` is always called: it receives
        ``optimizer.grad_scale`` (the scale, or None when the grads are already unscaled) and
        ``optimizer.found_inf`` (float32, 1 means skip) and handles both on the device.
        Closures are not supported while enabled.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_device_state("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            try:
                if state["stage"] is OptState.READY:
                    state["found_inf_per_device"] = self._check_grads(optimizer)
                    _combine_ranks(state["found_inf_per_device"], optimizer)
                optimizer.grad_scale = None if state["stage"] is OptState.UNSCALED else self._scale
                optimizer.found_inf = _combine(state["found_inf_per_device"].values(), self._scale.device)
                result = optimizer.step(*args, **kwargs)
            finally:
                optimizer.__dict__.pop("grad_scale", None)
                optimizer.__dict__.pop("found_inf", None)
                # The step plan the read-only pass checked is trusted by this step only.
                if "_checked_plan" in optimizer.__dict__:
                    optimizer._checked_plan = None
            state["stage"] = OptState.STEPPED
            return result

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        result = None
        # The only host sync: a plain optimizer cannot skip its own step.
        if not bool(_combine(state["found_inf_per_device"].values(), self._scale.device)):
            result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Backs the scale off if this iteration found inf/NaN, grows it after
        ``growth_interval`` clean iterations, or sets it to ``new_scale``; call once per
        iteration after every :meth:`step`. No host sync."""
        if not self._enabled:
            return
        scale, growth_tracker = self._check_device_state("update")
        found_inf = self._iteration_found_inf()
        if new_scale is not None:
            if isinstance(new_scale, (int, float)):
                scale.fill_(new_scale)
            else:
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                scale.copy_(new_scale)
        else:
            if found_inf is None:
                raise AssertionError("No inf checks were recorded prior to update.")
            ops.update_scale_(
                scale, growth_tracker, self._hysteresis_tracker, found_inf, self._growth_factor,
                self._backoff_factor, self._growth_interval, self._hysteresis, self._min_scale,
                self._max_scale,
            )
        if found_inf is not None:
            self._last_found_inf = found_inf
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    @property
    def step_skipped(self) -> Tensor:
        """Whether inf/NaN was found in this iteration's gradients, i.e. the optimizer step was
        (or will be) skipped: a 0-dim bool tensor on the scale's device, read without a sync.

        Known from :meth:`step` (or :meth:`unscale_`) on; after :meth:`update` it describes the
        iteration just finished until the next one checks its gradients. With several optimizers
        it is True if any of them found inf/NaN. Always False when disabled.
        """
        if not self._enabled:
            return torch.zeros((), dtype=torch.bool)
        found_inf = self._iteration_found_inf()
        if found_inf is None:
            found_inf = self._last_found_inf
        if found_inf is None:
            raise RuntimeError("step_skipped is known once step() or unscale_() has checked the gradients.")
        return found_inf != 0

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean iterations."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Sets the growth factor."""
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by when inf/NaN is found."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Sets the backoff factor."""
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        """How many clean iterations in a row grow the scale."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Sets the growth interval."""
        self._growth_interval = new_interval

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), plus ``hysteresis`` and
        ``_hysteresis_tracker``, ``min_scale``, ``max_scale`` where they are not the defaults;
        empty when disabled. Syncs with the device; take it after :meth:`update`."""
        if not self._enabled:
            return {}
        state = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": _value_of(self._growth_tracker, self._init_growth_tracker),
        }
        if self._hysteresis != 1:
            state["hysteresis"] = self._hysteresis
            state["_hysteresis_tracker"] = _value_of(self._hysteresis_tracker, self._init_hysteresis_tracker)
        if self._min_scale != 0.0:
            state["min_scale"] = self._min_scale
        if self._max_scale != math.inf:
            state["max_scale"] = self._max_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a :meth:`state_dict` of this class or of ``torch.amp.GradScaler``; the optional
        entries it lacks take their defaults, as the dict was saved with them. No-op when disabled."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        self._init_scale = state_dict["scale"]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        self._hysteresis = state_dict.get("hysteresis", 1)
        self._init_hysteresis_tracker = state_dict.get("_hysteresis_tracker", self._hysteresis)
        self._min_scale = state_dict.get("min_scale", 0.0)
        self._max_scale = state_dict.get("max_scale", math.inf)
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # Device tensors are not pickled: the copy recreates them from these at its first scale().
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = _value_of(self._growth_tracker, self._init_growth_tracker)
            state["_init_hysteresis_tracker"] = _value_of(
                self._hysteresis_tracker, self._init_hysteresis_tracker
            )
            for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_last_found_inf"):
                state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _create_device_state(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=device
        )

    # torch.amp.GradScaler's names for the two above, which clients call (accelerate's FSDP2
    # load_state initializes a freshly loaded scaler with the first).
    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        self._create_device_state(torch.device(dev))

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[Tensor, Tensor]:
        return self._check_device_state(funcname)

    def _check_device_state(self, funcname: str) -> tuple[Tensor, Tensor]:
        fix = (
            "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
            "iteration."
        )
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _inv_scale(self) -> Tensor:
        # The reciprocal is taken in float64 and rounded once, as torch does, so that the
        # unscaled gradients are bitwise torch's for any scale, not only powers of two.
        return self._scale.double().reciprocal().float()

    def _check_grads(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        """found_inf per device without touching the grads (the fused optimizer unscales them)."""
        inv_scale = self._inv_scale()
        check = getattr(optimizer, "_fusedamp_check_grads", None)
        if check is not None:
            # The optimizer's own pass also takes the unscaled grad norm for fused clipping.
            return check(inv_scale)
        found_inf_per_device = {}
        for device, grads in _grads_by_device(optimizer).items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            ops.check_and_norm_(grads, found_inf)
            found_inf_per_device[device] = found_inf
        return found_inf_per_device

    def _iteration_found_inf(self) -> Tensor | None:
        """Every found_inf recorded since the last update(), summed on the scale's device."""
        found_infs = [
            found_inf
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        return _combine(found_infs, self._scale.device) if found_infs else None


def _combine_ranks(
    found_inf_per_device: dict[torch.device, Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """With DTensor (FSDP2) grads each rank checked only its shards: sums every found_inf over
    the ranks of their device meshes, in place, so that all ranks skip the same steps."""
    plain = getattr(optimizer, "_fusedamp_plain_grads", None)
    if plain is not None and plain():
        return
    meshes = _dtensor.meshes_of(
        param.grad for group in optimizer.param_groups for param in group["params"]
        if param.grad is not None
    )
    if meshes:
        for found_inf in found_inf_per_device.values():
            _dtensor.all_reduce_sum_(found_inf, meshes)


def _grads_by_device(optimizer: torch.optim.Optimizer) -> dict[torch.device, list[Tensor]]:
    """The optimizer's gradients (the values of sparse ones, the local shards of DTensors),
    grouped by device; dtypes mix."""
    grads: defaultdict[torch.device, list[Tensor]] = defaultdict(list)
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    # Duplicate indices are summed by coalescing, which may overflow fp16:
                    # check the values as the optimizer will see them.
                    if grad.dtype == torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads[grad.device].append(_dtensor.local(grad))
    return grads


def _combine(found_infs: Iterable[Tensor], device: torch.device) -> Tensor:
    """One found_inf on ``device`` from several, without a sync: 1.0 if any is not 0 (a count, a
    sum over ranks or NaN: [note: found_inf] in csrc/include/fusedamp/math/scale.h), else 0.0.
    Exactly 0 or 1 because torch's fused optimizers skip on ``== 1`` and subtract found_inf
    from their step counts."""
    moved = [found_inf.to(device, non_blocking=True) for found_inf in found_infs]
    if not moved:
        return torch.zeros((), dtype=torch.float32, device=device)
    total = moved[0] if len(moved) == 1 else torch.stack(moved).sum()
    return (total != 0).float()


def _value_of(tracker: Tensor | None, initial: int) -> int:
    return initial if tracker is None else int(tracker.item())

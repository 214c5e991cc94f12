"""What the host holds of each param of an offloaded optimizer (its *slot*: a host copy that the CPU
step updates, a host grad buffer) and the copies between the slots and the params' device."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusedamp import ops
from fusedamp.optim.offload.buffers import HostBuffers, host_layout
from fusedamp.optim.offload.transfers import Transfers


@dataclass(eq=False)
class Slot:
    """One param of an offloaded optimizer and what the host holds of it."""

    index: int  # position among the slots (the param's entry in the device checks)
    param: Tensor
    group: dict[str, Any]
    host: Tensor | None = None  # the host copy the CPU step updates
    grad: Tensor | None = None  # the host grad buffer, laid out like the host copy
    # `grad` holds the param's grad. Without offload_gradients a copy of param.grad (current while
    # `source` says so), with it the grad itself (param.grad was freed).
    has_grad: bool = False
    zeroed: bool = False  # ... zeroed by zero_grad(set_to_none=False) (offload_gradients)
    source: tuple[weakref.ref[Tensor], int] | None = None  # the grad copied into `grad`, its _version
    synced: tuple[int, int] | None = None  # the param's (data_ptr, _version) when `host` was equal
    host_ready: Any = None  # event: the param's copy into `host` is done
    grad_ready: Any = None  # event: the grad's copy into `grad` is done
    param_ready: Any = None  # event: the copy of `host` back into the param is done
    in_backward: bool = False  # the hooks copied this round's grad
    eager: bool = False  # stepped (or queued to be) in this round's backward (step_in_backward)
    arrival: int | None = None  # where its grad first landed in backward, in the order they landed
    queued: bool = False  # waiting in the bucket of grads that backward copies next
    # Its hook's runs since the last step(), and between the first two (a param used by two
    # reentrant checkpoints, or by each micro-batch, runs it several times: only after the last
    # run is backward done reading the param).
    fired: int = 0
    expected: int | None = None
    # offload_delay: `busy` while a delayed step on the worker thread reads and writes `host` and
    # `grad`; `behind` once it has, until `host` is copied back (the param lags it meanwhile);
    # `early` once copied back in backward (after its expected hook runs).
    busy: bool = False
    behind: bool = False
    early: bool = False


class HostCopies:
    """The slots of an offloaded optimizer's params, their host buffers and the transfers.

    >>> copies = HostCopies(torch.device("cuda"))
    >>> slots = copies.add(model.parameters(), group)
    >>> copies.stage(slots, [slot.param.grad for slot in slots], offload_gradients=False)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.transfers = Transfers(device)
        self.buffers = HostBuffers(pin=self.transfers.cuda)
        self.slots: list[Slot] = []
        self.slot_of: dict[int, Slot] = {}
        # offload_gradients: each param's non-finite flag and sum of squares, on the device.
        self._checks: tuple[Tensor, Tensor] | None = None
        # What moved and what was stepped where, for tests and profiling.
        self.counts: Counter[str] = Counter()

    def add(self, params: Iterable[Tensor], group: dict[str, Any]) -> list[Slot]:
        """Slots for the params not seen yet: host copies and grads in one allocation for the params
        that require grad (the others get theirs when they first need them)."""
        new = [param for param in dict.fromkeys(params) if id(param) not in self.slot_of]
        with_grads = [param for param in new if param.requires_grad]
        specs = [(*host_layout(param), param.dtype) for param in with_grads]
        views = self.buffers.allocate(specs + specs) if specs else []
        pairs = zip(views[: len(specs)], views[len(specs) :], strict=True)
        buffers = dict(zip(map(id, with_grads), pairs, strict=True))
        slots = []
        for param in new:
            slot = Slot(len(self.slots), param, group)
            slot.host, slot.grad = buffers.get(id(param), (None, None))
            self.slots.append(slot)
            self.slot_of[id(param)] = slot
            slots.append(slot)
        return slots

    def sync(self, slots: Iterable[Slot]) -> None:
        """Copies each param into its host copy unless the two are known to be equal (made anew if
        the param's dtype or layout changed); a param changed by hand replaces the update its host
        copy held for it (offload_delay)."""
        stale = []
        for slot in slots:
            param = slot.param
            if slot.host is not None and slot.synced == (param.data_ptr(), param._version):
                continue
            shape, strides = host_layout(param)
            host = slot.host
            if host is None or host.dtype != param.dtype or host.shape != shape or host.stride() != strides:
                slot.host = self.buffers.allocate([(shape, strides, param.dtype)])[0]
                slot.grad, slot.has_grad, slot.source = None, False, None
            stale.append(slot)
        if not stale:
            return
        event = self.transfers.to_host(
            [slot.host for slot in stale], [slot.param.detach() for slot in stale],
            after=[slot.param_ready for slot in stale],
        )
        for slot in stale:
            slot.host_ready = event
            slot.synced = (slot.param.data_ptr(), slot.param._version)
            slot.behind = False
        self.counts["params copied to the host"] += len(stale)

    def stage(self, slots: Sequence[Slot], grads: Sequence[Tensor], offload_gradients: bool) -> None:
        """Copies each grad (dense, its param's shape) into its slot's host grad; with
        offload_gradients takes the grads' checks first and frees them on the device."""
        for slot, grad in zip(slots, grads, strict=True):
            assert slot.host is not None
            if slot.grad is None or slot.grad.dtype != grad.dtype:
                slot.grad = self.buffers.allocate([(slot.host.shape, slot.host.stride(), grad.dtype)])[0]
        if offload_gradients:
            grads = [self._check(slot, grad) for slot, grad in zip(slots, grads, strict=True)]
        event = self.transfers.to_host([slot.grad for slot in slots], grads, free=offload_gradients)
        for slot, grad in zip(slots, grads, strict=True):
            slot.grad_ready = event
            slot.has_grad, slot.zeroed = True, False
            slot.source = None if offload_gradients else (weakref.ref(grad), grad._version)
            if offload_gradients:
                slot.param.grad = None

    def _check(self, slot: Slot, grad: Tensor) -> Tensor:
        """Takes ``grad``'s non-finite flag and sum of squares into the slot's device checks
        (offload_gradients); returns the grad to copy."""
        if slot.has_grad and slot.zeroed:
            grad = grad + 0  # as torch adds it into the zeroed grad (0 + -0 is +0)
        found, sums = self.checks_of(slot)
        if slot.has_grad and not slot.zeroed:  # a grad set by hand replaces the host one
            found.zero_()
            sums.zero_()
        ops.check_and_norm_([grad], found, sums)
        return grad

    def copy_back(self, slots: Sequence[Slot], after: Iterable[Any] = ()) -> None:
        """Copies the host copies into their params, after the events ``after``."""
        if not slots:
            return
        event = self.transfers.to_device([slot.param for slot in slots], [slot.host for slot in slots], after)
        for slot in slots:
            param = slot.param
            slot.param_ready = event
            slot.synced = (param.data_ptr(), param._version)
            slot.behind = False

    @staticmethod
    def holds(slot: Slot, grad: Tensor) -> bool:
        """Whether the slot's host grad is a copy of ``grad`` as it is now."""
        source = slot.source
        return slot.has_grad and source is not None and source[0]() is grad and source[1] == grad._version

    def checks_of(self, slot: Slot) -> tuple[Tensor, Tensor]:
        """The slot's non-finite flag and sum of squares (0-dim views) in the device checks."""
        checks = self.device_checks()
        return checks[0][slot.index], checks[1][slot.index]

    def device_checks(self) -> tuple[Tensor, Tensor]:
        """Every slot's non-finite flag and sum of squares (offload_gradients), on the device."""
        checks = self._checks
        if checks is None or checks[0].numel() < len(self.slots):
            fresh = tuple(torch.zeros(len(self.slots), dtype=torch.float32, device=self.device) for _ in "fs")
            if checks is not None:
                for new, old in zip(fresh, checks, strict=True):
                    new[: old.numel()].copy_(old)
            self._checks = checks = fresh  # type: ignore[assignment]
        return checks

    def zero_checks(self) -> None:
        if self._checks is not None:
            for checks in self._checks:
                checks.zero_()

    def buffer_bytes(self, state_bytes: int) -> dict[str, int]:
        """state_bytes()'s offload entries (see FusedOptimizer.state_bytes)."""

        def nbytes(tensor: Tensor | None) -> int:
            return 0 if tensor is None else tensor.numel() * tensor.element_size()

        return {
            "params": sum(nbytes(slot.host) for slot in self.slots),
            "grads": sum(nbytes(slot.grad) for slot in self.slots),
            "host": state_bytes + self.buffers.allocated_bytes(),
            "device": 0 if self._checks is None else sum(map(nbytes, self._checks)),
        }

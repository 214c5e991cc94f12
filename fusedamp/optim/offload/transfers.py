"""Copies between an offloaded optimizer's device and the host.

On a GPU they are asynchronous, on two side streams (``d2h`` and ``h2d``), a list of tensors per
call (one C++ loop of ``cudaMemcpyAsync``, one event for all of them); with the params on the CPU
they are plain copies and return no event, so the offloaded path runs and is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

HOST = torch.device("cpu")


class Transfers:
    """The copies of one device, each call returning the event that marks its end (None on the CPU).

    >>> transfers = Transfers(torch.device("cuda"))
    >>> grads_landed = transfers.to_host(host_grads, [p.grad for p in params])
    >>> transfers.wait(grads_landed)  # the host may read host_grads now
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def to_host(
        self,
        hosts: Sequence[Tensor],
        sources: Sequence[Tensor],
        after: Iterable[Any] = (),
        free: bool = False,
    ) -> Any:
        """Copies each of ``sources`` into its host tensor after the work queued so far on the
        current stream (which made them) and after the events ``after``. ``free``: the caller
        drops the sources right away, so their memory is kept from reuse until the copies read it."""
        if self.cuda and hosts:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        event = self._copy(self.d2h if self.cuda else None, hosts, sources, after)
        if free and self.cuda:
            for source in sources:
                source.record_stream(self.d2h)
        return event

    def to_device(self, targets: Sequence[Tensor], hosts: Sequence[Tensor], after: Iterable[Any] = ()) -> Any:
        """Copies each host tensor into its target after the events ``after`` (and the work made
        to wait by ``before_writes``)."""
        return self._copy(self.h2d if self.cuda else None, targets, hosts, after)

    @staticmethod
    def _copy(stream: Any, targets: Sequence[Tensor], sources: Sequence[Tensor], after: Iterable[Any]) -> Any:
        """``targets[i].copy_(sources[i])`` for each i: on ``stream`` after the events ``after``, one
        event for all; in place (no stream: the CPU) and no event."""
        if not targets:
            return None
        if stream is None:
            torch._foreach_copy_(list(targets), list(sources))
            return None
        for event in dict.fromkeys(event for event in after if event is not None):
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            torch._foreach_copy_(list(targets), list(sources), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def snapshot(self, tensors: Sequence[Tensor | None]) -> tuple[list[Tensor | None], Any]:
        """Host copies of ``tensors`` (the AMP scalars of a step that the worker thread runs later)
        as they are after the work queued so far, and the event that marks them landed."""
        if not self.cuda:
            return [None if t is None else t.detach().to(HOST, copy=True) for t in tensors], None
        current = torch.cuda.current_stream(self.device)
        copies: list[Tensor | None] = []
        for tensor in tensors:
            if tensor is None or tensor.device.type == "cpu":
                copies.append(None if tensor is None else tensor.detach().clone())
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            copies.append(host)
        event = torch.cuda.Event()
        event.record(current)
        return copies, event

    @staticmethod
    def wait(event: Any) -> None:
        """Blocks the host until the copies of ``event`` are done."""
        if event is not None:
            event.synchronize()

    def before_writes(self) -> None:
        """The copies to the device queued from now on run after every use of the params queued
        so far on the current stream (the forward and backward that read them)."""
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    def fence(self) -> None:
        """The work queued from now on on the current stream runs after every copy queued so far,
        both ways (on the device: the host does not wait): the next forward sees the params copied
        back, and a grad freed after this may be reused at once."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.h2d)
            current.wait_stream(self.d2h)

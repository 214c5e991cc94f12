"""The backward side of an offloaded optimizer: a post-accumulate-grad hook per param that records
the order in which the grads land and queues each grad into a bucket; the grads of a bucket go to
the host together (one call, one event) once the bucket holds BUCKET_BYTES, and at the end of each
backward (an autograd callback).

The hook itself only records and queues: the copies, the checks of a param edited since its host
copy was made and the hand-over to the CPU step happen once per bucket, so that backward's own
thread (which queues the device's work) loses as little time per param as it can.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor

from fusedamp.optim.offload.options import MULTI_RANK, OffloadOptions, grads_final_in_backward
from fusedamp.optim.offload.slots import Slot

# Bytes of grads per bucket: ~1 ms over PCIe 5, a small share of a backward that offload is worth for.
BUCKET_BYTES = 32 << 20
_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})


def _on_grad(backward: weakref.ref[Backward], index: int, param: Tensor) -> None:
    """The post-accumulate-grad hook of an offloaded param (a weak reference: the model's params
    do not keep a dropped optimizer alive)."""
    owner = backward()
    if owner is not None:
        owner.on_grad(owner.slots[index])


class Backward:
    """The hooks, the order of arrival and the bucket of grads not yet copied (module docstring);
    ``copy`` takes each full bucket and ``finish`` runs at the end of each backward (weak methods:
    their owner owns this object).

    >>> backward = Backward(slots, options, "FusedAdamW", weakref.WeakMethod(executor.copy_grads_in_backward),
    ...                     weakref.WeakMethod(executor.end_of_backward))
    >>> backward.register(slots)  # one hook per param that requires grad
    >>> with backward.no_sync():  # grads stay on the device (gradient accumulation)
    ...     loss.backward()
    """

    def __init__(
        self,
        slots: list[Slot],
        options: OffloadOptions,
        name: str,
        copy: weakref.WeakMethod[Callable[[list[Slot]], None]],
        finish: weakref.WeakMethod[Callable[[], None]],
    ) -> None:
        self.slots, self.options, self.name, self._copy, self._finish = slots, options, name, copy, finish
        self.hooks: list[Any] = []
        self.arrivals = 0  # slots whose arrival is recorded
        self.bucket: list[Slot] = []
        self.bucket_bytes = 0
        self.no_sync_depth = 0
        self._running = False  # between a backward's first hook and its end
        self._final = True  # this backward's grads are final in its hooks (no DDP all-reduce after)

    def register(self, slots: list[Slot]) -> None:
        for slot in slots:
            if slot.param.requires_grad:
                hook = partial(_on_grad, weakref.ref(self), slot.index)
                self.hooks.append(slot.param.register_post_accumulate_grad_hook(hook))

    def on_grad(self, slot: Slot) -> None:
        """A param's grad is accumulated: record its arrival and queue it (see the module docstring)."""
        if slot.arrival is None:
            slot.arrival = self.arrivals
            self.arrivals += 1
        slot.fired += 1
        if slot.early:
            raise RuntimeError(
                f"{self.name}(offload_delay=1): backward reached a param that already took its "
                f"delayed update: its hook ran {slot.fired} times since the last step(), more than the "
                f"{slot.expected} of the first step, after whose last the update goes into the param. "
                "Keep the backwards per step() (micro-batches, checkpointed segments) at most as many "
                "as in the first step"
            )
        if not self._running:  # the first hook of this backward
            self._running = True
            self._final = grads_final_in_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.no_sync_depth:
            return
        param = slot.param
        grad = param.grad
        if grad is None or grad.is_sparse or grad.shape != param.shape or type(grad) not in _PLAIN_TENSORS:
            return  # step() copies (or refuses) it, as the step would take it without offload
        options = self.options
        if not self._final:
            if options.offload_gradients or options.step_in_backward:
                raise RuntimeError(MULTI_RANK)
            return  # DDP reduces the grads after this hook: step() copies them
        if slot.eager:
            raise RuntimeError(
                f"{self.name}(step_in_backward=True): a second backward reached a param stepped by the "
                "first before step(); run the micro-batches but the last inside "
                "`with optimizer.offload_no_sync():`"
            )
        if options.offload_gradients and slot.has_grad and not slot.zeroed and not slot.queued:
            raise RuntimeError(
                f"{self.name}(offload_gradients=True): a backward reached a param whose grad is already "
                "on the host (a second micro-batch, or no zero_grad() after step()); run the "
                "micro-batches but the last inside `with optimizer.offload_no_sync():`, where the grads "
                "add up on the device"
            )
        if not slot.queued:  # a param whose hook runs twice in one backward is copied once, at its end
            slot.queued = True
            self.bucket.append(slot)
            self.bucket_bytes += grad.numel() * grad.element_size()
        if self.bucket_bytes >= BUCKET_BYTES:
            self.flush()

    def _end_of_backward(self) -> None:
        self._running = False
        self.flush()
        finish = self._finish()
        if finish is not None:
            finish()

    def flush(self) -> None:
        """Hands the bucket's grads over to be copied to the host."""
        bucket, self.bucket, self.bucket_bytes = self.bucket, [], 0
        for slot in bucket:
            slot.queued = False
        bucket = [slot for slot in bucket if slot.param.grad is not None]
        copy = self._copy()
        if bucket and copy is not None:
            copy(bucket)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward leaves the grads on the device inside (see FusedOptimizer.offload_no_sync)."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

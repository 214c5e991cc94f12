"""Optimizer offload (``offload="cpu"``): the state and the step on the host, the params and grads on
their device (docs/offload.md).

Per param the optimizer keeps a *host copy* (the tensor the CPU step updates, in the param's dtype
and layout) and a *host grad* buffer; both are views of a few large allocations, page-locked with
``cudaHostRegister`` when the params are on a GPU (torch's pinned allocator would round each
block up to a power of two). The state is made like the host copies by the optimizer's usual code
(``_state_of``), in ordinary host memory: it never travels, so it is not page-locked.

One step:

1. backward: each param's post-accumulate-grad hook copies its grad into its host grad on a side
   stream (``d2h``) that first waits for the work queued so far on the current stream (which made
   the grad), and records an event. With ``offload_gradients`` the hook also takes the grad's
   non-finite flag and sum of squares on the device (``check_and_norm_`` into this param's slot of
   two small device tensors) and frees the grad (``record_stream`` keeps its memory until the copy
   has read it). A param changed since its host copy was made (``param._version`` or its storage
   differ: ``model.load_state_dict``, ``clamp_``, ``p.data = ...``) is copied to the host too.
2. ``step()``: grads the hooks did not copy, or that changed after their copy (``scaler.unscale_``,
   ``clip_grad_norm_``, DDP's all-reduce: [note: grads after backward]), are copied now. found_inf
   and the clip norm are reduced on the device, by the same passes as without offload (or from the
   hooks' per-param values with ``offload_gradients``), and copied to the host once. Then the CPU
   steps the params chunk by chunk in the optimizer's order, waiting only on the copies of the
   chunk's grads, and copies each chunk's params back on another stream (``h2d``) while it steps
   the next. ``step()`` returns once the last copy is queued, after making the current stream wait
   for the ``h2d`` stream: the next forward (any work queued on that stream) runs after the params
   landed, and the host never waits for them.
3. ``step_in_backward=True``: the hooks also hand each param to a worker thread that steps it as
   soon as its grad landed, while backward goes on (the fused CPU ops release the GIL); step() then
   waits for the worker and steps only what backward did not reach.

With the params on the CPU the same code runs with plain copies (no streams, no events), so every
rule above is tested on machines without a GPU.

[note: grads after backward]
A grad is final when its hook runs unless something changes it before step(): DDP all-reduces the
grads after the hooks, ``scaler.unscale_`` and ``clip_grad_norm_`` rewrite them. The host grad
therefore remembers which grad tensor, at which ``_version``, it was copied from, and step() copies
again any grad that is not that one any more. Under a process group of more than one rank (DDP) the
hooks copy nothing: step() copies the reduced grads, chunk by chunk as it steps.
"""

from __future__ import annotations

import ctypes
import math
import queue
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from fusedamp import _C, _dtensor, ops
from fusedamp._layout import is_dense
from fusedamp.optim._plan import PlannedOptimizer, group_signature, same_signature
from fusedamp.optim._step import AmpScalars, Bucket, on_device


class OffloadedOptimizer(PlannedOptimizer, Protocol):
    """What offloading reads and calls of its optimizer (a ``fusedamp.optim._base.FusedOptimizer``)."""

    max_grad_norm: float | None
    _pending_clip_coef: Tensor | None

    def offload_no_sync(self) -> AbstractContextManager[None]: ...

    def _buckets(
        self, host_copies: Iterable[tuple[dict[str, Any], Tensor, Tensor, Tensor]] | None = None
    ) -> list[Bucket]: ...

    def _step_native(self, bucket: Bucket, scalars: AmpScalars) -> None: ...

    def _step_bucket(self, bucket: Bucket, scalars: AmpScalars, **overrides: Any) -> None: ...

    def _dense_grad(self, param: Tensor, grad: Tensor) -> Tensor: ...

    def _clip_coef(self, sums: dict[torch.device, Tensor]) -> Tensor: ...

    def _check_hyperparameters(self) -> None: ...

    def _check_and_norm(
        self, inv_scale: Tensor | None, remember_plan: bool = False
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]: ...


OffloadTarget = Literal["cpu"]
OFFLOAD_TARGETS = (None, "cpu")
# Elements of params per chunk of an offloaded step: each chunk's params are copied back while
# the CPU steps the next one (a chunk of 16M bf16 params is 32 MB, ~1 ms over PCIe 5).
CHUNK_ELEMENTS = 1 << 24
# Every host buffer starts on a cache line; each allocation on a page (cudaHostRegister pins pages).
_ALIGN = 64
_PAGE = 4096
_HOST = torch.device("cpu")
_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})


def check_options(
    offload: str | None, offload_gradients: bool, step_in_backward: bool, max_grad_norm: float | None
) -> None:
    """The constructor's checks of the offload keywords."""
    if offload not in OFFLOAD_TARGETS:
        raise ValueError(
            f"Invalid offload value: {offload!r}; expected None (state and step on the params' "
            "device) or 'cpu' (state and step on the host, params and grads on their device)"
        )
    if offload is None:
        if offload_gradients or step_in_backward:
            raise ValueError("offload_gradients and step_in_backward need offload='cpu'")
        return
    if step_in_backward and max_grad_norm is not None:
        raise ValueError(
            "step_in_backward=True steps each param as its grad arrives, before the global grad norm "
            "that max_grad_norm clips by is known: use one or the other"
        )
    if (offload_gradients or step_in_backward) and not grads_final_in_backward():
        raise ValueError(_MULTI_RANK)


_MULTI_RANK = (
    "offload_gradients and step_in_backward act in backward, before DistributedDataParallel "
    "all-reduces the grads: under a process group of more than one rank use offload='cpu' alone "
    "(step() then copies the reduced grads)"
)


def grads_final_in_backward() -> bool:
    """Whether a grad is final when its post-accumulate-grad hook runs: not under a process group
    of more than one rank, where DDP all-reduces the grads after the hooks."""
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


# --- host buffers and transfers ------------------------------------------------------------------


def _host_layout(param: Tensor) -> tuple[torch.Size, tuple[int, ...]]:
    """The shape and strides of a param's host copy: the param's own when it is dense (any memory
    format), else contiguous, as the kernels step a param with gaps through a contiguous copy."""
    if is_dense(param):
        return param.shape, param.stride()
    strides, step = [], 1
    for size in reversed(param.shape):
        strides.append(step)
        step *= max(size, 1)
    return param.shape, tuple(reversed(strides))


def _page_aligned(nbytes: int) -> Tensor:
    """``nbytes`` of host memory starting on a page, in a tensor whose storage starts there too:
    torch's ``is_pinned()`` asks CUDA about a storage's first byte, which must lie in the range
    that cudaHostRegister locks (a slice of a larger tensor would report unpinned memory)."""
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    if nbytes == 0:
        return raw[:0]
    window = (ctypes.c_char * nbytes).from_address(raw.data_ptr() + (-raw.data_ptr() % _PAGE))
    window.owner = raw  # the tensor below holds the window, the window holds the memory
    return torch.frombuffer(window, dtype=torch.uint8)


class _HostBuffers:
    """Host tensors carved out of few allocations, page-locked (``cudaHostRegister``) when they
    are copied to and from a GPU; ``blocks`` are the allocations, ``registered`` their pinned
    addresses (both released by _release)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.blocks: list[Tensor] = []
        self.registered: list[int] = []

    def allocate(self, specs: Sequence[tuple[torch.Size, tuple[int, ...], torch.dtype]]) -> list[Tensor]:
        """A tensor per (shape, strides, dtype), all in one new allocation."""
        offsets, total = [], 0
        for shape, _, dtype in specs:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        block = _page_aligned(total)
        self.blocks.append(block)
        if self.pin and total:
            self._register(block)
        views = []
        for (shape, strides, dtype), offset in zip(specs, offsets, strict=True):
            flat = block[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype)
            views.append(flat.as_strided(shape, strides))
        return views

    def _register(self, block: Tensor) -> None:
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(block.data_ptr(), block.numel(), 1)  # cudaHostRegisterPortable
        if int(result) != 0:
            warnings.warn(
                f"fusedamp offload: cudaHostRegister of {block.numel()} bytes failed "
                f"({cudart.cudaGetErrorString(result)}); the copies of these buffers will not overlap "
                "with compute (raise the locked-memory limit, ulimit -l)",
                stacklevel=4,
            )
            return
        self.registered.append(block.data_ptr())


class _Transfers:
    """Copies between the params' device and the host. On a GPU they are asynchronous, on two side
    streams, each returning the event that marks its end; with the params on the CPU they are plain
    copies and return no event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def to_host(self, host: Tensor, source: Tensor, after: Any = None) -> Any:
        """Copies ``source`` into ``host`` after the work queued so far on the current stream
        (which made it) and after event ``after``."""
        if not self.cuda:
            host.copy_(source)
            return None
        stream = self.d2h
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
        source.record_stream(stream)  # its memory is not reused before the copy has read it
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def to_device(self, target: Tensor, host: Tensor, after: Any = None) -> Any:
        """Copies ``host`` into ``target`` after event ``after`` (and the work made to wait by
        ``before_writes``)."""
        if not self.cuda:
            target.copy_(host)
            return None
        stream = self.h2d
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            target.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(event: Any) -> None:
        """Blocks the host until the copy of ``event`` is done."""
        if event is not None:
            event.synchronize()

    def before_writes(self) -> None:
        """The copies to the device queued from now on run after every use of the params queued
        so far on the current stream (the forward and backward that read them)."""
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    def fence(self) -> None:
        """The work queued from now on on the current stream runs after every copy to the device
        queued so far (on the device: the host does not wait)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)


class _Worker:
    """One host thread running tasks in order, started at the first task. A task's error is
    raised by the next drain()."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, task: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fusedamp-offload", daemon=True)
            self._thread.start()
        self._tasks.put(task)

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"fusedamp offload: a step in backward failed: {error}") from error

    def close(self) -> None:
        if self._thread is not None:
            self._tasks.put(None)

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException as error:  # raised again by drain(), on the caller's thread
                with self._idle:
                    self._error = self._error or error
            finally:
                task = None
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


# --- per param -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
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


@dataclass
class _Chunk:
    """Params stepped together (their buckets) and copied back while the next chunk steps."""

    slots: list[_Slot]
    buckets: list[Bucket]


def _host_copies(slots: Iterable[_Slot]) -> list[tuple[dict[str, Any], Tensor, Tensor, Tensor]]:
    return [(slot.group, slot.param, slot.host, slot.grad) for slot in slots]


class _OffloadPlan:
    """The chunks of the last offloaded step with their buckets (and op calls), reused while
    nothing they were built from changed: the same slots with the same host tensors and groups,
    the same group options (but those read at each call), state dicts and group param lists."""

    def __init__(self, optimizer: OffloadedOptimizer, key: tuple[int, ...], chunks: list[_Chunk]) -> None:
        self.key = key
        self.chunks = chunks
        self.state = optimizer.state
        self.groups = [
            (group, group["params"], group_signature(optimizer, group)) for group in optimizer.param_groups
        ]
        states = [state for chunk in chunks for bucket in chunk.buckets for state in bucket.states]
        self.same_objects = _C.IdentityWatch(
            [optimizer.state, *states], [params for _, params, _ in self.groups]
        )

    @classmethod
    def build(
        cls, optimizer: OffloadedOptimizer, key: tuple[int, ...], chunks: list[_Chunk]
    ) -> _OffloadPlan | None:
        if not all(type(group["params"]) is list for group in optimizer.param_groups):
            return None
        return cls(optimizer, key, chunks)

    def fits(self, optimizer: OffloadedOptimizer, key: tuple[int, ...]) -> bool:
        if key != self.key or optimizer.state is not self.state:
            return False
        if len(optimizer.param_groups) != len(self.groups):
            return False
        for group, (planned, params, signature) in zip(optimizer.param_groups, self.groups, strict=True):
            if group is not planned or group["params"] is not params:
                return False
            if not same_signature(group_signature(optimizer, group), signature):
                return False
        return self.same_objects.unchanged()


def _on_backward(offload: weakref.ref[Offload], index: int, param: Tensor) -> None:
    """The post-accumulate-grad hook of an offloaded param (a weak reference: the model's params
    do not keep a dropped optimizer alive)."""
    owner = offload()
    if owner is not None and owner._optimizer() is not None:
        owner.on_backward(owner.slots[index])


def _release(hooks: list[Any], worker: _Worker, registered: list[int], blocks: list[Tensor]) -> None:
    """Undoes what an Offload set up: its hooks, its thread, its page-locked host memory."""
    for handle in hooks:
        handle.remove()
    worker.close()
    if registered:
        torch.cuda.synchronize()  # no copy may still read or write the memory unpinned below
        cudart = torch.cuda.cudart()
        for pointer in registered:
            cudart.cudaHostUnregister(pointer)
    registered.clear()
    blocks.clear()


# --- the offloaded optimizer's host side --------------------------------------------------------


class Offload:
    """The host side of an offloaded FusedOptimizer: the host copies and grads of its params,
    the backward hooks, the transfers and the CPU step (see the module docstring)."""

    def __init__(
        self, optimizer: OffloadedOptimizer, offload_gradients: bool, step_in_backward: bool
    ) -> None:
        # A weak reference: the optimizer owns this object, which its params' hooks reach (weakly).
        self._optimizer = weakref.ref(optimizer)
        self.offload_gradients = offload_gradients
        self.step_in_backward = step_in_backward
        params = [param for group in optimizer.param_groups for param in group["params"]]
        self.device = _device_of(params, type(optimizer).__name__)
        self.transfers = _Transfers(self.device)
        self.buffers = _HostBuffers(pin=self.transfers.cuda)
        self.slots: list[_Slot] = []
        self._slot_of: dict[int, _Slot] = {}
        self._hooks: list[Any] = []
        self._worker = _Worker()
        self._ready: list[_Slot] = []  # handed to the worker, not yet taken by it
        self._ready_lock = threading.Lock()
        self._no_sync_depth = 0
        # offload_gradients: each param's non-finite flag and sum of squares, on the device.
        self._checks: tuple[Tensor, Tensor] | None = None
        self._plan: _OffloadPlan | None = None
        # What moved and what was stepped where, for tests and profiling.
        self.counts: Counter[str] = Counter()
        release = weakref.finalize(
            self, _release, self._hooks, self._worker, self.buffers.registered, self.buffers.blocks
        )
        release.atexit = False  # the process's end frees it all
        for group in optimizer.param_groups:
            self.add_params(group["params"], group)

    @property
    def optimizer(self) -> OffloadedOptimizer:
        optimizer = self._optimizer()
        assert optimizer is not None, "the offloaded optimizer was dropped"
        return optimizer

    # --- params ----------------------------------------------------------------------------------

    def add_params(self, params: Iterable[Tensor], group: dict[str, Any]) -> None:
        """Slots for the params not seen yet: host copies and grads (one allocation for the params
        that require grad; the others get theirs when they first need them) and backward hooks."""
        name = type(self.optimizer).__name__
        new = [param for param in params if id(param) not in self._slot_of]
        _device_of([*new, *(slot.param for slot in self.slots[:1])], name)
        with_grads = [param for param in new if param.requires_grad]
        specs = [(*_host_layout(param), param.dtype) for param in with_grads]
        views = self.buffers.allocate(specs + specs) if specs else []
        pairs = zip(views[: len(specs)], views[len(specs) :], strict=True)
        buffers = dict(zip(map(id, with_grads), pairs, strict=True))
        for param in new:
            slot = _Slot(len(self.slots), param, group)
            slot.host, slot.grad = buffers.get(id(param), (None, None))
            self.slots.append(slot)
            self._slot_of[id(param)] = slot
            if param.requires_grad:
                hook = partial(_on_backward, weakref.ref(self), slot.index)
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))

    def regroup(self) -> None:
        """Points each slot at its param's group (after load_state_dict made new group dicts)."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                slot = self._slot_of.get(id(param))
                if slot is not None:
                    slot.group = group

    def host_of(self, param: Tensor) -> Tensor:
        """The host copy of ``param``, equal to it (copied now if it changed); ``param`` itself
        if the optimizer does not hold it."""
        slot = self._slot_of.get(id(param))
        if slot is None:
            groups = [
                group for group in self.optimizer.param_groups if any(p is param for p in group["params"])
            ]
            if not groups:
                return param
            self.add_params([param], groups[0])
            slot = self._slot_of[id(param)]
        with self._device_context(), torch.no_grad():
            self._sync_host(slot)
        self.transfers.wait(slot.host_ready)
        assert slot.host is not None
        return slot.host

    # --- backward ----------------------------------------------------------------------------------

    def on_backward(self, slot: _Slot) -> None:
        """A param's grad is accumulated: copy it to the host (see the module docstring)."""
        if self._no_sync_depth:
            return
        param = slot.param
        grad = param.grad
        if grad is None or grad.is_sparse or grad.shape != param.shape or type(grad) not in _PLAIN_TENSORS:
            return  # step() copies (or refuses) it, as the step would take it without offload
        if not grads_final_in_backward():
            if self.offload_gradients or self.step_in_backward:
                raise RuntimeError(_MULTI_RANK)
            return  # DDP reduces the grads after this hook: step() copies them
        if slot.eager:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}(step_in_backward=True): a second backward reached "
                "a param stepped by the first before step(); run the micro-batches but the last "
                "inside `with optimizer.offload_no_sync():`"
            )
        if self.offload_gradients and slot.has_grad and not slot.zeroed:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}(offload_gradients=True): a backward reached a "
                "param whose grad is already on the host (a second micro-batch, or no zero_grad() "
                "after step()); run the micro-batches but the last inside "
                "`with optimizer.offload_no_sync():`, where the grads add up on the device"
            )
        with torch.no_grad():
            self._stage(slot, grad)
            if self.offload_gradients:
                param.grad = None
        slot.in_backward = True
        self.counts["grads copied in backward"] += 1
        if self.step_in_backward:
            slot.eager = True
            with self._ready_lock:
                self._ready.append(slot)
            self._worker.submit(self._step_ready)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward leaves the grads on the device inside (see FusedOptimizer.offload_no_sync)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def _stage(self, slot: _Slot, grad: Tensor) -> None:
        """Copies ``grad`` (dense, the param's shape) into the slot's host grad, and the param into
        its host copy if it changed; with offload_gradients takes the grad's checks first."""
        self._sync_host(slot)
        assert slot.host is not None
        if slot.grad is None or slot.grad.dtype != grad.dtype:
            slot.grad = self.buffers.allocate([(slot.host.shape, slot.host.stride(), grad.dtype)])[0]
        if self.offload_gradients:
            if slot.has_grad and slot.zeroed:
                grad = grad + 0  # as torch adds it into the zeroed grad (0 + -0 is +0)
            found, sums = self._checks_of(slot)
            if slot.has_grad and not slot.zeroed:  # a grad set by hand replaces the host one
                found.zero_()
                sums.zero_()
            ops.check_and_norm_([grad], found, sums)
        slot.grad_ready = self.transfers.to_host(slot.grad, grad)
        slot.has_grad, slot.zeroed = True, False
        slot.source = None if self.offload_gradients else (weakref.ref(grad), grad._version)

    def _sync_host(self, slot: _Slot) -> None:
        """Copies the param into its host copy unless the two are known to be equal (made anew if
        the param's dtype or layout changed)."""
        param = slot.param
        if slot.host is not None and slot.synced == (param.data_ptr(), param._version):
            return
        shape, strides = _host_layout(param)
        host = slot.host
        if host is None or host.dtype != param.dtype or host.shape != shape or host.stride() != strides:
            slot.host = self.buffers.allocate([(shape, strides, param.dtype)])[0]
            slot.grad, slot.has_grad, slot.source = None, False, None
        slot.host_ready = self.transfers.to_host(slot.host, param.detach(), after=slot.param_ready)
        slot.synced = (param.data_ptr(), param._version)
        self.counts["params copied to the host"] += 1

    def _checks_of(self, slot: _Slot) -> tuple[Tensor, Tensor]:
        """The slot's non-finite flag and sum of squares (0-dim views) in the device checks."""
        checks = self._device_checks()
        return checks[0][slot.index], checks[1][slot.index]

    def _device_checks(self) -> tuple[Tensor, Tensor]:
        checks = self._checks
        if checks is None or checks[0].numel() < len(self.slots):
            fresh = tuple(torch.zeros(len(self.slots), dtype=torch.float32, device=self.device) for _ in "fs")
            if checks is not None:
                for new, old in zip(fresh, checks, strict=True):
                    new[: old.numel()].copy_(old)
            self._checks = checks = fresh  # type: ignore[assignment]
        return checks

    # --- step --------------------------------------------------------------------------------------

    @torch.compiler.disable
    def step(self, inv_scale: Tensor | None, found_inf: Tensor | None, scaled: bool) -> None:
        """The offloaded step (see the module docstring); ``scaled``: a GradScaler handed over
        the scale (else found_inf comes with grads it says are unscaled)."""
        optimizer = self.optimizer
        name = type(optimizer).__name__
        self.drain()
        if found_inf is not None and not isinstance(found_inf, Tensor):
            # torch.amp.GradScaler's sum of the found_inf of no grads at all.
            if self.offload_gradients:
                raise RuntimeError(
                    f"{name}(offload_gradients=True): torch.amp.GradScaler found no grads on the "
                    "params (backward moved them to the host): use fusedamp.GradScaler, which asks "
                    "the optimizer, or offload_gradients=False"
                )
            found_inf = None
        with self._device_context(), torch.no_grad():
            if found_inf is not None and not scaled and not self.offload_gradients:
                # A scaler's unscale_() rewrote the grads after their copies (torch's does so
                # without bumping their versions): copy them all again.
                for slot in self.slots:
                    slot.source = None
            todo = self._stage_grads()
            if found_inf is not None or optimizer.max_grad_norm is not None:
                if any(slot.eager for slot in self.slots):
                    raise RuntimeError(
                        f"{name}(step_in_backward=True) stepped during backward, before a GradScaler's "
                        "found_inf (or the clip norm) was known: use it without a GradScaler and "
                        "max_grad_norm, or with step_in_backward=False"
                    )
            if self.offload_gradients and found_inf is not None and not scaled:
                if any(slot.in_backward for slot in todo):
                    raise RuntimeError(
                        f"{name}(offload_gradients=True): scaler.unscale_() cannot reach the grads "
                        "backward moved to the host; clip with max_grad_norm and call "
                        "scaler.step(optimizer) without unscale_()"
                    )
            clip_coef, optimizer._pending_clip_coef = optimizer._pending_clip_coef, None
            if clip_coef is None and optimizer.max_grad_norm is not None and todo:
                if self.offload_gradients:
                    _, sums = self.device_checks(inv_scale, with_norm=True)
                else:
                    _, sums = optimizer._check_and_norm(inv_scale)
                clip_coef = optimizer._clip_coef(sums)
            scalars = AmpScalars(*(on_device(scalar, _HOST) for scalar in (inv_scale, found_inf, clip_coef)))
            self.transfers.before_writes()
            self._step_slots(todo, scalars, planned=True)
            self.transfers.fence()
        for slot in self.slots:
            slot.eager = slot.in_backward = False

    def _stage_grads(self) -> list[_Slot]:
        """Copies the grads the hooks did not (or that changed since: [note: grads after
        backward]); returns the slots this step updates, in the optimizer's order: those with a
        grad (a host grad, with offload_gradients) not stepped in backward."""
        optimizer = self.optimizer
        todo = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                slot = self._slot_of.get(id(param))
                if slot is None:
                    self.add_params([param], group)
                    slot = self._slot_of[id(param)]
                slot.group = group
                if slot.eager:
                    continue
                grad = param.grad
                if grad is not None:
                    grad = optimizer._dense_grad(param, grad)
                    if not self._holds(slot, grad):
                        self._stage(slot, grad)
                        self.counts["grads copied in step"] += 1
                        if self.offload_gradients:
                            param.grad = None
                elif not (self.offload_gradients and slot.has_grad):
                    continue
                self._sync_host(slot)  # the param may have changed after backward
                todo.append(slot)
        return todo

    @staticmethod
    def _holds(slot: _Slot, grad: Tensor) -> bool:
        """Whether the slot's host grad is a copy of ``grad`` as it is now."""
        source = slot.source
        return slot.has_grad and source is not None and source[0]() is grad and source[1] == grad._version

    def device_checks(
        self, inv_scale: Tensor | None, with_norm: bool
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """found_inf and the sum of squares of the unscaled grads from the per-param checks of
        offload_gradients (the read-only pass of _clipping.check_and_norm, which cannot read
        the freed grads): new device tensors, no host sync."""
        self.drain()
        with self._device_context(), torch.no_grad():
            self._stage_grads()
            found_flags, sums = self._device_checks()
            found = {self.device: (found_flags != 0).any().float()}
            if not with_norm:
                return found, {}
            total = sums.sum()
            if inv_scale is not None:
                inv = on_device(inv_scale, self.device)
                total = total * (inv * inv)  # the hooks summed the scaled grads
            return found, {self.device: total}

    def _step_slots(self, slots: list[_Slot], scalars: AmpScalars, planned: bool) -> None:
        """Steps ``slots`` on the host, chunk by chunk, and copies each chunk back to the device."""
        wait = self.transfers.wait
        for slot in slots:
            wait(slot.host_ready)  # the buckets may make masters from the host copies
            wait(slot.param_ready)  # and the step rewrites them
        if planned:
            chunks = self._chunks(slots)
        else:
            chunks = [_Chunk(slots, self.optimizer._buckets(_host_copies(slots)))] if slots else []
        for chunk in chunks:
            for slot in chunk.slots:
                wait(slot.grad_ready)
            for bucket in chunk.buckets:
                self._step_bucket(bucket, scalars)
            for slot in chunk.slots:
                param = slot.param
                slot.param_ready = self.transfers.to_device(param, slot.host, after=slot.grad_ready)
                slot.synced = (param.data_ptr(), param._version)
        self.counts["params stepped"] += len(slots)

    def _chunks(self, slots: list[_Slot]) -> list[_Chunk]:
        """The chunks of ``slots``: the plan's while it fits, else new ones (and their plan)."""
        optimizer = self.optimizer
        key = tuple(id(item) for slot in slots for item in (slot.host, slot.grad, slot.group))
        plan = self._plan
        if plan is not None and plan.fits(optimizer, key):
            return plan.chunks
        members: list[list[_Slot]] = []
        elements = CHUNK_ELEMENTS
        for slot in slots:
            if elements >= CHUNK_ELEMENTS:
                members.append([])
                elements = 0
            members[-1].append(slot)
            elements += slot.param.numel()
        chunks = [_Chunk(chunk, optimizer._buckets(_host_copies(chunk))) for chunk in members]
        self._plan = _OffloadPlan.build(optimizer, key, chunks)
        return chunks

    def _step_bucket(self, bucket: Bucket, scalars: AmpScalars) -> None:
        optimizer = self.optimizer
        if bucket.native:
            optimizer._step_native(bucket, scalars)
            return
        # The host grads are a copy that the next backward overwrites: not worth the write.
        optimizer._step_bucket(bucket, scalars, write_unscaled_grads=False)

    def _step_ready(self) -> None:
        """The worker's task (step_in_backward): steps the params whose grads the hooks handed
        over since the last task, in one batch."""
        with self._ready_lock:
            batch, self._ready = self._ready, []
        if not batch:
            return
        with self._device_context(), torch.no_grad():
            self.optimizer._check_hyperparameters()
            self._step_slots(batch, AmpScalars(None, None, None), planned=False)
        self.counts["params stepped in backward"] += len(batch)

    def drain(self) -> None:
        """Waits for the steps in backward (and raises their errors)."""
        self._worker.drain()

    def zero_grad(self, set_to_none: bool) -> None:
        """After torch's zero_grad: the host grads follow the params' grads. Without
        offload_gradients they are copies, dropped; with it they are the grads: dropped, or
        zeroed (``set_to_none=False``), as torch treats .grad."""
        for slot in self.slots:
            if set_to_none or not self.offload_gradients:
                slot.has_grad = slot.zeroed = False
                slot.source = None
            elif slot.has_grad and slot.grad is not None:
                self.transfers.wait(slot.grad_ready)
                slot.grad.zero_()
                slot.zeroed = True
        if self._checks is not None:
            for checks in self._checks:
                checks.zero_()

    def buffer_bytes(self, state_bytes: int) -> dict[str, int]:
        """state_bytes()'s offload entries (see FusedOptimizer.state_bytes)."""

        def nbytes(tensor: Tensor | None) -> int:
            return 0 if tensor is None else tensor.numel() * tensor.element_size()

        allocated = sum(block.numel() for block in self.buffers.blocks)
        device = 0 if self._checks is None else sum(map(nbytes, self._checks))
        return {
            "params": sum(nbytes(slot.host) for slot in self.slots),
            "grads": sum(nbytes(slot.grad) for slot in self.slots),
            "host": state_bytes + allocated,
            "device": device,
        }

    def _device_context(self) -> Any:
        return torch.cuda.device(self.device) if self.transfers.cuda else nullcontext()


def _device_of(params: Sequence[Tensor], name: str) -> torch.device:
    """The one device of ``params``, or a clear error for what offload does not take."""
    for index, param in enumerate(params):
        if _dtensor.is_dtensor(param):
            raise TypeError(
                f"{name}(offload='cpu') offloads plain params; param {index} is a DTensor (FSDP2, "
                "tensor parallel). FSDP2 has its own offload: fully_shard(module, "
                "offload_policy=CPUOffloadPolicy()) keeps the shards and their grads on the host, "
                f"where a {name} without offload steps them (docs/offload.md)"
            )
    devices = sorted({str(param.device) for param in params})
    if len(devices) > 1:
        raise ValueError(
            f"{name}(offload='cpu') needs every param on one device; they are on {', '.join(devices)} "
            "(make one optimizer per device)"
        )
    device = params[0].device if params else _HOST
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{name}(offload='cpu') offloads from a CUDA device (or, with plain copies, from the "
            f"CPU); the params are on {device}"
        )
    return device

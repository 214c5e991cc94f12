"""The offloaded executor: steps an optimizer's buckets on the host, from host copies of its params
and grads, and copies the params back (see the package docstring for the whole picture)."""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor

from fusedamp.optim._executor import Executor, Stepper
from fusedamp.optim._step import AmpScalars, on_device
from fusedamp.optim.offload.backward import Backward
from fusedamp.optim.offload.buffers import release
from fusedamp.optim.offload.chunks import Chunk, ChunkPlan, in_arrival_order
from fusedamp.optim.offload.options import OffloadOptions, device_of
from fusedamp.optim.offload.slots import HostCopies, Slot
from fusedamp.optim.offload.transfers import HOST
from fusedamp.optim.offload.worker import Worker


def _release(hooks: list[Any], worker: Worker, registered: list[int], blocks: list[Tensor]) -> None:
    """Undoes what an OffloadExecutor set up: its hooks, its thread, its page-locked host memory."""
    for handle in hooks:
        handle.remove()
    worker.close()
    release(registered, blocks)


class OffloadExecutor(Executor):
    """Steps an optimizer's params on the host (``offload="cpu"``, docs/offload.md): host copies of
    the params and grads (slots.py), the hooks that copy the grads in backward (backward.py), the
    chunks stepped in the order the grads land, the copies back, and the delayed update.

    >>> opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu")  # makes one
    >>> opt._executor.copies.counts["grads copied in backward"]
    """

    def __init__(self, optimizer: Stepper, options: OffloadOptions) -> None:
        super().__init__(optimizer)
        self.options = options
        self.name = type(optimizer).__name__
        params = [param for group in optimizer.param_groups for param in group["params"]]
        self.copies = HostCopies(device_of(params, self.name))
        self.transfers = self.copies.transfers
        self.backward = Backward(
            self.copies.slots,
            options,
            self.name,
            weakref.WeakMethod(self.copy_grads_in_backward),
            weakref.WeakMethod(self.end_of_backward),
        )
        self._worker = Worker()
        self._ready: list[Slot] = []  # handed to the worker by backward, not yet taken by it
        self._ready_lock = threading.Lock()
        # offload_delay: guards each slot's busy and behind, which the worker clears and sets.
        self._settled = threading.Condition()
        self._delaying = False  # past the warm-up: the update is delayed
        self._mirrors: dict[int, dict[str, Any]] = {}  # the groups as a delayed step reads them
        self._plan = ChunkPlan()
        # Step in the order the grads land in backward (False: in the optimizer's order).
        self.arrival_order = True
        finalize = weakref.finalize(
            self, _release, self.backward.hooks, self._worker, self.copies.buffers.registered,
            self.copies.buffers.blocks,
        )
        finalize.atexit = False  # the process's end frees it all
        for group in optimizer.param_groups:
            self.add_params(group["params"], group)

    @property
    def slots(self) -> list[Slot]:
        return self.copies.slots

    @property
    def counts(self) -> Any:
        return self.copies.counts

    # --- params ----------------------------------------------------------------------------------

    def add_params(self, params: list[Tensor], group: dict[str, Any]) -> None:
        self.drain()
        device_of([*params, *(slot.param for slot in self.slots[:1])], self.name)
        self.backward.register(self.copies.add(params, group))

    def after_load(self) -> None:
        """Points each slot at its param's group (load_state_dict made new group dicts); the warm-up
        of the delayed update is counted again from the loaded step counts."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                slot = self.copies.slot_of.get(id(param))
                if slot is not None:
                    slot.group = group
        self._delaying = False

    def host_of(self, param: Tensor) -> Tensor:
        """The host copy of ``param`` (copied now if the param changed); ``param`` itself if the
        optimizer does not hold it."""
        self.drain()
        slot = self.copies.slot_of.get(id(param))
        if slot is None:
            groups = [g for g in self.optimizer.param_groups if any(p is param for p in g["params"])]
            if not groups:
                return param
            self.add_params([param], groups[0])
            slot = self.copies.slot_of[id(param)]
        with self._device_context(), torch.no_grad():
            self.copies.sync([slot])
        self.transfers.wait(slot.host_ready)
        assert slot.host is not None
        return slot.host

    stepped = host_of
    state_like = host_of

    # --- backward --------------------------------------------------------------------------------

    def copy_grads_in_backward(self, bucket: list[Slot]) -> None:
        """A bucket of grads backward made (backward.py): copied to the host, and handed to the CPU
        step with step_in_backward. With offload_delay, each of its params whose hook ran for the
        last time in this step (as the first step counted) then takes its delayed update: backward
        no longer reads it."""
        options = self.options
        with self._device_context(), torch.no_grad():
            self._settle(bucket)
            self.copies.sync(bucket)
            self.copies.stage(bucket, [slot.param.grad for slot in bucket], options.offload_gradients)
            # A param's update goes back after its last hook run of a step, as counted in the first.
            done = self._catch_up([s for s in bucket if s.fired == s.expected], after=[bucket[0].grad_ready])
            for slot in done:
                slot.early = True
        for slot in bucket:
            slot.in_backward = True
        self.counts["grads copied in backward"] += len(bucket)
        self.counts["grad buckets copied in backward"] += 1
        if options.step_in_backward:
            for slot in bucket:
                slot.eager = True
            with self._ready_lock:
                self._ready.extend(bucket)
            self._worker.submit(self._step_ready)

    def end_of_backward(self) -> None:
        """With step_in_backward, backward returns once the params it handed over are stepped: the
        next forward reads their updates, and a second backward without offload_no_sync meets its
        clear error instead of racing the copies back (autograd's in-place check, or stale params)."""
        if self.options.step_in_backward:
            self.drain()

    def no_sync(self) -> AbstractContextManager[None]:
        return self.backward.no_sync()

    # --- step --------------------------------------------------------------------------------------

    @torch.compiler.disable
    def prepare(self, found_inf: Tensor | float | None, scaled: bool) -> list[Slot]:
        """Copies the grads the hooks did not (or that changed since: [note: grads after
        backward]) and returns the slots this step updates, in the optimizer's order."""
        name = self.name
        self.drain()
        self.backward.flush()
        offload_gradients = self.options.offload_gradients
        if found_inf is not None and not isinstance(found_inf, Tensor) and offload_gradients:
            # torch.amp.GradScaler's sum of the found_inf of no grads at all.
            raise RuntimeError(
                f"{name}(offload_gradients=True): torch.amp.GradScaler found no grads on the params "
                "(backward moved them to the host): use fusedamp.GradScaler, which asks the optimizer, "
                "or offload_gradients=False"
            )
        found_inf = found_inf if isinstance(found_inf, Tensor) else None
        with self._device_context(), torch.no_grad():
            if found_inf is not None and not scaled and not offload_gradients:
                # A scaler's unscale_() rewrote the grads after their copies (torch's does so
                # without bumping their versions): copy them all again.
                for slot in self.slots:
                    slot.source = None
            self._catch_up([slot for slot in self.slots if slot.behind])
            todo = self._stage_grads()
        optimizer = self.optimizer
        global_facts = found_inf is not None or optimizer.max_grad_norm is not None
        if global_facts and any(slot.eager for slot in self.slots):
            raise RuntimeError(
                f"{name}(step_in_backward=True) stepped during backward, before a GradScaler's found_inf "
                "(or the clip norm) was known: use it without a GradScaler and max_grad_norm, or with "
                "step_in_backward=False"
            )
        if offload_gradients and found_inf is not None and not scaled and any(s.in_backward for s in todo):
            raise RuntimeError(
                f"{name}(offload_gradients=True): scaler.unscale_() cannot reach the grads backward "
                "moved to the host; clip with max_grad_norm and call scaler.step(optimizer) without "
                "unscale_()"
            )
        return todo

    def _stage_grads(self) -> list[Slot]:
        """prepare()'s copies: the slots with a grad (a host grad, with offload_gradients) not
        stepped in backward."""
        optimizer = self.optimizer
        todo, staged, grads = [], [], []
        for group in optimizer.param_groups:
            for param in group["params"]:
                slot = self.copies.slot_of.get(id(param))
                if slot is None:
                    self.add_params([param], group)
                    slot = self.copies.slot_of[id(param)]
                slot.group = group
                if slot.eager:
                    continue
                grad = param.grad
                if grad is not None:
                    grad = optimizer._dense_grad(param, grad)
                    if not self.copies.holds(slot, grad):
                        staged.append(slot)
                        grads.append(grad)
                elif not (self.options.offload_gradients and slot.has_grad):
                    continue
                todo.append(slot)
        self.copies.sync(todo)  # a param may have changed after backward
        self.copies.stage(staged, grads, self.options.offload_gradients)
        self.counts["grads copied in step"] += len(staged)
        return todo

    def check_and_norm(
        self, inv_scale: Tensor | None, with_norm: bool, remember_plan: bool = False
    ) -> tuple[dict[torch.device, Tensor], dict[torch.device, Tensor]]:
        """As without offload, but with offload_gradients from the per-param checks the hooks took
        (the grads are gone from the device): new device tensors, no host sync."""
        if not self.options.offload_gradients:
            return super().check_and_norm(inv_scale, with_norm, remember_plan)
        self.drain()
        self.backward.flush()
        with self._device_context(), torch.no_grad():
            self._stage_grads()
            found_flags, sums = self.copies.device_checks()
            found = {self.copies.device: (found_flags != 0).any().float()}
            if not with_norm:
                return found, {}
            total = sums.sum()
            if inv_scale is not None:
                inv = on_device(inv_scale, self.copies.device)
                total = total * (inv * inv)  # the hooks summed the scaled grads
            return found, {self.copies.device: total}

    @torch.compiler.disable
    def run(self, work: list[Slot], scalars: AmpScalars) -> None:
        """Steps ``work`` on the host: now, copying each chunk back as it is done; or, once the
        delayed update runs, on the worker thread while the next forward and backward run."""
        with self._device_context(), torch.no_grad():
            if self._delayed():
                self._step_later(work, scalars)
            else:
                host = AmpScalars(*(on_device(s, HOST) for s in (scalars.inv_grad_scale, scalars.found_inf,
                                                                   scalars.clip_coef)))
                self.transfers.before_writes()
                self._step_chunks(self._chunks(work), host, copy_back=True)
                self.transfers.fence()
        for slot in self.slots:
            slot.eager = slot.in_backward = slot.early = False
            if slot.expected is None:
                slot.expected = slot.fired
            slot.fired = 0

    def _chunks(self, slots: list[Slot], groups: dict[int, dict[str, Any]] | None = None) -> list[Chunk]:
        """The chunks of ``slots`` (see chunks.py), in the order their grads landed or in the
        optimizer's; ``groups``: the delayed step's copies of the param groups."""
        for slot in slots:
            self.transfers.wait(slot.host_ready)  # the buckets may make masters from the host copies
        ordered = in_arrival_order(slots) if self.arrival_order else slots
        return self._plan.chunks(self.optimizer, ordered, groups or {})

    def _step_chunks(self, chunks: list[Chunk], scalars: AmpScalars, copy_back: bool) -> None:
        """Steps ``chunks`` on the host; each chunk is copied back as it is done (``copy_back``), or
        left behind its params for a delayed update."""
        wait = self.transfers.wait
        optimizer = self.optimizer
        for chunk in chunks:
            for slot in chunk.slots:
                wait(slot.param_ready)  # the step rewrites the host copies that a copy back reads
                wait(slot.grad_ready)
            for bucket in chunk.buckets:
                # The host grads are a copy that the next backward overwrites: not worth the write.
                optimizer._run_bucket(bucket, scalars, write_grads=False)
            if copy_back:
                self.copies.copy_back(chunk.slots, after=[slot.grad_ready for slot in chunk.slots])
            else:
                with self._settled:
                    for slot in chunk.slots:
                        slot.busy, slot.behind = False, True
                    self._settled.notify_all()
            self.counts["params stepped"] += len(chunk.slots)

    def _step_ready(self) -> None:
        """The worker's task (step_in_backward): steps the params whose grads backward handed
        over since the last task, in one batch."""
        with self._ready_lock:
            batch, self._ready = self._ready, []
        if not batch:
            return
        with self._device_context(), torch.no_grad():
            self.optimizer._check_hyperparameters()
            for slot in batch:
                self.transfers.wait(slot.host_ready)  # the buckets may make masters from the host copies
            chunk = Chunk(batch, self.optimizer._buckets([(s.group, s.param, s.host, s.grad) for s in batch]))
            self._step_chunks([chunk], AmpScalars(None, None, None), copy_back=True)
        self.counts["params stepped in backward"] += len(batch)

    # --- the delayed update (offload_delay=1) ------------------------------------------------------

    def _delayed(self) -> bool:
        """Whether this step's update is delayed: offload_delay=1, past the warm-up (the largest
        step count of a param has reached offload_delay_warmup)."""
        if not self.options.delay:
            return False
        if not self._delaying:
            counts = (state.get("step") for state in self.optimizer.state.values())
            most = max((float(count) for count in counts if isinstance(count, Tensor)), default=0.0)
            self._delaying = most >= self.options.delay_warmup
        return self._delaying

    def _step_later(self, work: list[Slot], scalars: AmpScalars) -> None:
        """Hands ``work`` to the worker thread, which steps it while the caller runs the next forward
        and backward with the params as they are (each param gets its update back in that backward,
        once its grad is made, or in the next step())."""
        self.transfers.fence()  # the next forward sees the updates copied back; grads may be freed
        groups = self._mirror_groups()
        chunks = self._chunks(work, groups)
        values, landed = self.transfers.snapshot(
            [scalars.inv_grad_scale, scalars.found_inf, scalars.clip_coef]
        )
        with self._settled:
            for slot in work:
                slot.busy = True
        self._worker.submit(partial(self._step_round, chunks, values, landed, work))

    def _mirror_groups(self) -> dict[int, dict[str, Any]]:
        """Copies of the param groups as they are now, which the worker's step reads while the
        caller changes the groups for the next step (an LR scheduler)."""
        for group in self.optimizer.param_groups:
            mirror = self._mirrors.setdefault(id(group), {})
            mirror.clear()
            for key, value in group.items():
                mirror[key] = value.detach().to(HOST, copy=True) if isinstance(value, Tensor) else value
        return self._mirrors

    def _step_round(
        self, chunks: list[Chunk], values: list[Tensor | None], landed: Any, work: list[Slot]
    ) -> None:
        """The worker's task (offload_delay): one step's chunks, each left behind its params."""
        try:
            self.transfers.wait(landed)
            with torch.no_grad():
                self._step_chunks(chunks, AmpScalars(*values), copy_back=False)
        finally:  # after an error too: backward must not wait for these slots forever
            with self._settled:
                for slot in work:
                    slot.busy = False
                self._settled.notify_all()

    def _settle(self, slots: list[Slot]) -> None:
        """Waits until the delayed step is done with ``slots`` (their host copies and grads)."""
        if self.options.delay:
            with self._settled:
                self._settled.wait_for(lambda: not any(slot.busy for slot in slots))

    def _catch_up(self, slots: list[Slot], after: list[Any] | None = None) -> list[Slot]:
        """Copies back the delayed updates of ``slots`` that their params lag (those changed by hand
        since take the param's value instead), after ``after`` (else after the work queued so far);
        returns the slots copied back."""
        if not any(slot.behind for slot in slots):
            return []
        self.copies.sync(slots)
        behind = [slot for slot in slots if slot.behind]
        if after is None:
            self.transfers.before_writes()
        self.copies.copy_back(behind, after=after or ())
        return behind

    def delayed_params(self) -> dict[int, Tensor]:
        self.drain()
        return {id(slot.param): slot.host for slot in self.slots if slot.behind and slot.host is not None}

    def load_delayed(self, param: Tensor, value: Tensor) -> None:
        """Puts a checkpoint's pending update into the host copy: copied back by the next step (or
        its backward) with offload_delay, now without."""
        host = self.host_of(param)
        slot = self.copies.slot_of[id(param)]
        host.copy_(value)
        slot.behind = True
        if not self.options.delay:
            self.flush()

    def flush(self) -> None:
        self.drain()
        with self._device_context(), torch.no_grad():
            self._catch_up([slot for slot in self.slots if slot.behind])
            self.transfers.fence()

    # --- the rest of the optimizer's life ----------------------------------------------------------

    def drain(self) -> None:
        """Waits for the steps on the worker thread (and raises their errors)."""
        self._worker.drain()

    def before_zero_grad(self, set_to_none: bool) -> None:
        # A delayed step reads the host grads, which zero_grad keeps (offload_gradients) or leaves
        # alone; the steps in backward must be done before their flags are reset.
        if not self.options.delay or (self.options.offload_gradients and not set_to_none):
            self.drain()

    def after_zero_grad(self, set_to_none: bool) -> None:
        """The host grads follow the params' grads. Without offload_gradients they are copies,
        dropped; with it they are the grads: dropped, or zeroed (``set_to_none=False``), as torch
        treats .grad."""
        for slot in self.slots:
            if set_to_none or not self.options.offload_gradients:
                slot.has_grad = slot.zeroed = False
                slot.source = None
            elif slot.has_grad and slot.grad is not None:
                self.transfers.wait(slot.grad_ready)
                slot.grad.zero_()
                slot.zeroed = True
        self.copies.zero_checks()

    def buffer_bytes(self, state_bytes: int) -> dict[str, int]:
        return self.copies.buffer_bytes(state_bytes)

    def check_picklable(self, name: str) -> None:
        raise TypeError(
            f"an offloaded {name} holds backward hooks, streams and host buffers and cannot be "
            "pickled or deep-copied; save its state_dict() instead"
        )

    def _device_context(self) -> Any:
        return torch.cuda.device(self.copies.device) if self.transfers.cuda else nullcontext()

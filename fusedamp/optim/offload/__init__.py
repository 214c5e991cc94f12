"""Optimizer offload (``offload="cpu"``): the state and the step on the host, the params and grads on
their device (docs/offload.md).

Per param the optimizer keeps a *slot* (slots.py): a host copy (the tensor the CPU step updates, in
the param's dtype and layout) and a host grad buffer, both views of a few large allocations,
page-locked when the params are on a GPU (buffers.py). The state is made like the host copies by the
optimizer's usual code, in ordinary host memory: it never travels, so it is not page-locked.

One step (executor.py), with the transfers of transfers.py and the hooks of backward.py:

1. backward: each param's post-accumulate-grad hook records where its grad landed in the order of
   arrival (the first backward's order is kept) and queues it into a bucket; each bucket of
   BUCKET_BYTES, and the rest at the end of backward, is copied to the host in one call on a side
   stream (``d2h``) that first waits for the work queued so far on the current stream (which made
   the grads), with one event. With ``offload_gradients`` the grads' non-finite flags and sums of
   squares are taken on the device first (``check_and_norm_`` into each param's slot of two small
   device tensors) and the grads freed. A param changed since its host copy was made
   (``param._version`` or its storage differ: ``model.load_state_dict``, ``clamp_``,
   ``p.data = ...``) is copied to the host too.
2. ``step()`` (FusedOptimizer.step computes found_inf and the clip coefficient on the device, once,
   for every executor): grads the hooks did not copy, or that changed after their copy
   (``scaler.unscale_``, ``clip_grad_norm_``, DDP's all-reduce: [note: grads after backward]), are
   copied now. Then the CPU steps the params chunk by chunk in the order their grads landed (the
   first chunks' grads are on the host first), waiting only on the copies of the chunk's grads, and
   copies each chunk's params back on another stream (``h2d``) while it steps the next. ``step()``
   returns once the last copy is queued, after making the current stream wait for the copies: the
   next forward (any work queued on that stream) runs after the params landed, and the host never
   waits for them.
3. ``step_in_backward=True``: each bucket is also handed to a worker thread (worker.py) that steps
   it as soon as its grads landed, while backward goes on (the fused CPU ops release the GIL);
   step() then waits for the worker and steps only what backward did not reach.
4. ``offload_delay=1`` (after ``offload_delay_warmup`` applied steps): step() hands the chunks to
   the worker thread and returns; the next forward and backward run with the params as they were
   (the update of the step before), while the CPU steps. As that backward makes each bucket of
   grads, the bucket's params (which it no longer reads) get their update copied back, once the
   worker is done with them; the next step() copies back the rest. The worker reads the AMP scalars
   and the param groups as they were at its step() (copies), not as a scheduler changed them since.

With the params on the CPU the same code runs with plain copies (no streams, no events), so every
rule above is tested on machines without a GPU.

[note: grads after backward]
A grad is final when its hook runs unless something changes it before step(): DDP all-reduces the
grads after the hooks, ``scaler.unscale_`` and ``clip_grad_norm_`` rewrite them. The host grad
therefore remembers which grad tensor, at which ``_version``, it was copied from, and step() copies
again any grad that is not that one any more. Under a process group of more than one rank (DDP) the
hooks copy nothing: step() copies the reduced grads.
"""

from fusedamp.optim.offload.executor import OffloadExecutor
from fusedamp.optim.offload.options import DELAY_WARMUP, DELAYED_KEY, OffloadOptions, OffloadTarget

__all__ = ["DELAYED_KEY", "DELAY_WARMUP", "OffloadExecutor", "OffloadOptions", "OffloadTarget"]

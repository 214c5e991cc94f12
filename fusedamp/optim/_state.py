"""The state half of a FusedOptimizer: each param's state made, converted and numbered, and the
whole state exported (state_dict, torch_state_dict, state_bytes) and loaded (load_state_dict).

The state of a DTensor param is kept as plain tensors like its local shard and exported as
DTensors (_dtensor_state.py); an offloaded optimizer keeps it on the host, beside the host copies
of the params (its executor says where each param's state lives and drains the worker first).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import Tensor

from fusedamp import _dtensor
from fusedamp._layout import is_dense, like
from fusedamp.optim import _codecs, _dtensor_state
from fusedamp.optim._executor import Executor
from fusedamp.optim._masters import (
    MASTER_KEY,
    REMAINDER_KEY,
    convert_master,
    join_bf16_remainder,
    state_dtype,
)
from fusedamp.optim._plan import StepPlan
from fusedamp.optim._step import Bucket
from fusedamp.optim.offload import DELAYED_KEY

__all__ = ["OptimizerState"]


class OptimizerState(torch.optim.Optimizer):
    """The state methods of FusedOptimizer (_base.py), which sets the attributes below.

    >>> opt = fusedamp.FusedAdamW(model.parameters(), moments="int8")
    >>> opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())  # coded on load
    """

    _executor: Executor  # where the state lives: on the params' devices, or offloaded
    _plan: StepPlan | None
    _checked_plan: StepPlan | None
    _param_indices: dict[int, int]

    def _index_params(self) -> None:
        # A param's position in the optimizer (over all groups, as state_dict numbers them): the
        # id its random bits (stochastic params, coded states) are drawn under, the same after a
        # resume.
        self._param_indices = {id(param): index for index, param in enumerate(self._indexed_params())}

    def _param_index(self, param: Tensor) -> int:
        index = self._param_indices.get(id(param))
        if index is None:  # a param put into a group by hand after the optimizer indexed them
            self._index_params()
            index = self._param_indices[id(param)]
        return index

    def _new_state(self, key: str, param: Tensor, state: dict[str, Any], moments: str = "fp32") -> Tensor:
        """A fresh state tensor for ``key`` shaped and laid out like ``param`` (the tensor the
        kernels step), a moment stored under the ``moments`` codec (its scales: one bfloat16 per
        256 elements); ``state`` holds the entries made before it."""
        if key == "step":
            return torch.zeros((), dtype=torch.float32, device=param.device)
        if key.endswith(_codecs.SCALES_SUFFIX):
            blocks = (param.numel() + _codecs.CODEC_BLOCK - 1) // _codecs.CODEC_BLOCK
            return torch.zeros(blocks, dtype=_codecs.SCALE_DTYPE, device=param.device)
        return torch.zeros_like(param, dtype=_codecs.CODED_DTYPES.get(moments, state_dtype(param.dtype)))

    def _state_of(self, param: Tensor, bucket: Bucket, work_param: Tensor) -> dict[str, Any]:
        """The state of ``param``, made like ``work_param`` (a DTensor's local shard, or the
        dense copy of a param with gaps) where it is missing."""
        state = self.state[param]
        moments = bucket.group["moments"]
        # One look per step at the first moment's dtype: a state made or loaded in another codec.
        first = state.get(bucket.state_keys[1]) if len(bucket.state_keys) > 1 else None
        fp32_dtype = state_dtype(work_param.dtype)
        if first is not None and first.dtype != _codecs.CODED_DTYPES.get(moments, fp32_dtype):
            _codecs.convert(state, bucket.state_keys, moments, fp32_dtype)
        for key in bucket.state_keys:
            if key not in state:
                state[key] = self._new_state(key, work_param, state, moments)
        master_key = bucket.master_key
        if (MASTER_KEY in state) != (master_key == MASTER_KEY) or (REMAINDER_KEY in state) != (
            master_key == REMAINDER_KEY
        ):
            convert_master(work_param, state, master_key)
        return state

    def master_of(self, param: Tensor) -> Tensor:
        """The fp32 value the optimizer updates for ``param``.

        The fp32 master itself, a rebuilt copy in remainder mode, or ``param.float()`` when the
        param has no master (fp32 params, ``master_weights=False``, no step taken yet).
        Offloaded, it is a host tensor (the host copy's value without a master).
        """
        state = self.state.get(param, {})
        if MASTER_KEY in state:
            return state[MASTER_KEY]
        stepped = self._executor.stepped(param)
        if REMAINDER_KEY in state:
            return join_bf16_remainder(stepped, state[REMAINDER_KEY])
        return stepped.detach().float()

    def _state_like(self, param: Tensor) -> Tensor:
        """The tensor whose device and layout the state of ``param`` takes: the host copy of an
        offloaded optimizer, a DTensor's local shard, else ``param``."""
        return self._executor.state_like(param)

    def _indexed_params(self) -> list[Tensor]:
        """The params in the order state_dict() numbers them."""
        return list(chain.from_iterable(group["params"] for group in self.param_groups))

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state_dict, with the state of DTensor params as DTensors.

        The state of a DTensor param (FSDP2, tensor parallel) is kept as plain tensors made like
        its local shard; here every per-element entry (moments, masters, remainders) becomes a
        DTensor with the param's mesh, placements and global shape, as torch.optim holds it, and
        the float32 block scales of 8-bit moments become a uint8 DTensor of each element's scale
        exponent (see _dtensor_state.py), so that torch.distributed.checkpoint saves and reshards
        it; ``step`` stays a plain tensor. The state of plain params is as the optimizer holds it.

        With ``offload_delay=1`` a param whose last update is not in it yet (the next forward does
        not see it) has that update under ``"delayed_param"``: the param as the optimizer made it.
        """
        self._executor.drain()
        state_dict = super().state_dict()
        packed = state_dict["state"]
        delayed = self._executor.delayed_params()
        for index, param in enumerate(self._indexed_params()):
            if _dtensor.is_dtensor(param) and index in packed:
                packed[index] = _dtensor_state.dtensor_entries(packed[index], param, f"param {index}")
            if id(param) in delayed:  # a new dict: packed[index] is the optimizer's own state
                packed[index] = {**packed.get(index, {}), DELAYED_KEY: delayed[id(param)]}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of the matching ``torch.optim`` optimizer.

        State is copied (never aliased) onto each param's device and into its memory format:
        steps as float32, moments as float32 (float64 / complex params: their own dtype), fp32
        masters as float32, remainders as int16. Missing entries (masters of a torch.optim
        state_dict) are made from the params at the next step.

        The state of a DTensor param must be DTensors on the param's mesh, placements and shape
        (this rank's shard is taken); the per-element scales of 8-bit moments are made into
        the local blocks' codes and scales (see state_dict). A plain tensor for a DTensor param
        (the rank-local form) is refused with a ValueError.

        An offloaded optimizer puts the state on the host, like each param's host copy. A
        ``"delayed_param"`` entry (see state_dict) goes back where it was with ``offload_delay=1``
        (the param keeps the value the model's checkpoint gave it, and takes the update at the
        next step: load the model first); without a delay the param takes it now.
        """
        state_dict = self._local_state_dict(state_dict)
        self._executor.drain()
        # torch would first copy every state tensor onto its param's device and cast it to the
        # param's dtype; the state is made below from the saved values instead.
        super().load_state_dict({**state_dict, "state": {}})
        self._executor.after_load()
        self._plan = self._checked_plan = None
        # torch casts every floating state tensor to its param's dtype, which would round the
        # fp32 moments and masters of half params: redo the cast from the saved values.
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = ((group, param) for group in self.param_groups for param in group["params"])
        for saved_id, (group, param) in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            state = self.state[param]
            local_param = self._state_like(param)
            device = local_param.device
            saved = dict(saved)
            delayed = saved.pop(DELAYED_KEY, None)
            for key, value in saved.items():
                if key == "step":
                    state[key] = torch.tensor(float(value), dtype=torch.float32, device=device)
                elif key.endswith(_codecs.SCALES_SUFFIX):
                    # bfloat16; float32 scales are the earlier format's, converted below.
                    state[key] = value.detach().to(device, copy=True, memory_format=torch.contiguous_format)
                elif isinstance(value, Tensor):
                    dtype = torch.int16 if key == REMAINDER_KEY else state_dtype(param.dtype)
                    if key == MASTER_KEY:
                        dtype = torch.float32
                    elif value.dtype in (torch.uint8, torch.bfloat16) and key not in (REMAINDER_KEY,):
                        dtype = value.dtype  # coded moments stay coded (converted below if need be)
                    value = value.detach()
                    if value.shape == local_param.shape and is_dense(local_param):
                        state[key] = like(value, local_param, dtype)
                    else:  # a param with gaps is stepped through a contiguous copy
                        state[key] = value.to(
                            device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True
                        )
                else:
                    state[key] = value  # a plain value (torch's load_state_dict ran without the state)
            # A torch.optim state (fp32 moments) is quantized into the group's codec now, so that
            # state_dict() and torch_state_dict() show what the next step will use.
            moment_keys = tuple(key for key in saved if key not in (MASTER_KEY, REMAINDER_KEY))
            _codecs.convert(state, moment_keys, group["moments"], state_dtype(param.dtype))
            if delayed is not None:
                self._executor.load_delayed(param, delayed)

    def _local_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each param's state in the local form the optimizer keeps (see
        _dtensor_state.local_entries); a new dict, ``state_dict`` is left as it is."""
        saved_ids = list(chain.from_iterable(group["params"] for group in state_dict["param_groups"]))
        params = self._indexed_params()
        if len(saved_ids) != len(params):
            return state_dict  # torch's load_state_dict says what does not match
        state = dict(state_dict["state"])
        for index, (saved_id, param) in enumerate(zip(saved_ids, params, strict=True)):
            saved = state.get(saved_id)
            if saved is not None:
                where = f"param {index} (saved as {saved_id!r})"
                state[saved_id] = _dtensor_state.local_entries(saved, param, where)
        return {**state_dict, "state": state}

    def state_bytes(self) -> dict[str, int]:
        """The bytes the optimizer state holds, measured from its tensors, by kind: ``masters``
        (fp32 masters, bf16 remainders), ``moments`` (moments and momentum buffers, in their
        codec), ``scales`` (the bfloat16 block scales of 8-bit moments) and ``other`` (step counts).

        Offloaded (all of the state is then on the host), also ``params`` and ``grads`` (the
        host copies of the params and the host grad buffers) and the totals by place: ``host``
        (the state and the host buffers as allocated) and ``device`` (what the optimizer holds
        on the params' device: with ``offload_gradients``, two floats per param).

        >>> opt = fusedamp.FusedAdamW(model.parameters(), moments="int8")
        >>> opt.state_bytes()["moments"]  # about 2 bytes per param after the first step
        """
        totals = {"masters": 0, "moments": 0, "scales": 0, "other": 0}
        for state in self.state.values():
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    continue
                local = _dtensor.local(value)
                if key in (MASTER_KEY, REMAINDER_KEY):
                    kind = "masters"
                elif key.endswith(_codecs.SCALES_SUFFIX):
                    kind = "scales"
                elif key == "step":
                    kind = "other"
                else:
                    kind = "moments"
                totals[kind] += local.numel() * local.element_size()
        totals.update(self._executor.buffer_bytes(sum(totals.values())))
        return totals

    def torch_state_dict(self) -> dict[str, Any]:
        """This optimizer's state_dict as the matching ``torch.optim`` optimizer keeps it: every
        moment as float32 values (8-bit codes and bf16 moments decoded) under torch's keys,
        without fusedamp's own entries (masters, scales); loadable by
        ``torch.optim.AdamW.load_state_dict`` (or ``SGD``'s), and by this class, which quantizes
        it back into the identical codes.

        >>> torch.optim.AdamW(model.parameters()).load_state_dict(opt.torch_state_dict())
        """
        native = self.state_dict()
        params = self._indexed_params()
        exported: dict[Any, dict[str, Any]] = {}
        for index, saved in native["state"].items():
            param = params[index]
            entry: dict[str, Any] = {}
            for key, value in saved.items():
                if key in (MASTER_KEY, REMAINDER_KEY, DELAYED_KEY) or key.endswith(_codecs.SCALES_SUFFIX):
                    continue
                coded = isinstance(value, Tensor) and value.dtype in (torch.uint8, torch.bfloat16)
                if coded and key != "step":
                    # Decoded from the state as kept (a DTensor param's: its local shard's).
                    value = _codecs.float_value(self.state[param], key)
                    if _dtensor.is_dtensor(param):
                        value = _dtensor_state.dtensor_entries({key: value}, param, f"param {index}")[key]
                entry[key] = value
            exported[index] = entry
        return {"state": exported, "param_groups": native["param_groups"]}

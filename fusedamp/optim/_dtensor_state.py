"""The form a DTensor param's optimizer state takes in ``state_dict()`` (docs/distributed-checkpoint.md).

An optimizer keeps the state of a DTensor param (FSDP2's ``fully_shard``, tensor parallel) as
plain tensors made like its local shard, which the kernels step. ``state_dict()`` hands every
per-element entry (moments in their codec, fp32 masters, bf16 remainders) out as a DTensor with
the param's device mesh, placements, global shape and stride, as torch.optim's own optimizers
hold it, so that ``torch.distributed.checkpoint`` saves each element once and reshards it for
another world size; ``step`` stays a plain 0-dim tensor. ``load_state_dict`` takes the local
shard back (:func:`local_entries`).

The float32 scales of 8-bit moments are one per 256 elements of a rank's *local* storage, a
layout that depends on the sharding. In the DTensor form, ``<key>_scales`` is instead a uint8
DTensor shaped like the param holding each element's block scale as its biased float32 exponent
e (a block scale is 2^(e - 127), or 0 for an all-zero block: e = 0; block_scale in
csrc/include/fusedamp/math/codec.h), so that it reshards elementwise with the codes. On load, a
local block whose elements all carry one exponent keeps its codes bitwise; any other block (the
checkpoint was written under another sharding) is decoded element by element and encoded again.
The int16 remainders of bf16 masters are int32 in the DTensor form: gloo and NCCL have no int16
collectives, which full state dicts (gathered DTensors) need.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import Tensor

from fusedamp import _dtensor
from fusedamp._layout import is_dense
from fusedamp.optim import _codecs
from fusedamp.optim._masters import REMAINDER_KEY

__all__ = [
    "block_codes", "dtensor_entries", "dtensor_state_dict", "element_exponents", "exponent_scales",
    "local_entries",
]

_MANTISSA_AND_SIGN = -0x7F800001  # int32 bits outside the exponent field: 0x807fffff


def _storage_flat(tensor: Tensor) -> Tensor:
    """A 1-D view of a dense ``tensor``'s elements in the order its storage holds them (the
    order the kernels and the codec's blocks walk)."""
    return tensor.as_strided((tensor.numel(),), (1,))


def _blocks(numel: int) -> int:
    return (numel + _codecs.CODEC_BLOCK - 1) // _codecs.CODEC_BLOCK


def exponent_scales(exponents: Tensor) -> Tensor:
    """The float32 scales 2^(e - 127) of biased exponents ``e`` (uint8; 0 gives 0.0), shaped
    and laid out like ``exponents``."""
    return (exponents.to(torch.int32) << 23).view(torch.float32)


def element_exponents(codes: Tensor, scales: Tensor) -> Tensor:
    """Each element's block scale as its biased float32 exponent: a uint8 tensor shaped and laid
    out like ``codes`` (dense), from the float32 ``scales`` of its blocks of 256 in storage order.

    >>> element_exponents(torch.zeros(300, dtype=torch.uint8), torch.tensor([1.0, 0.0]))[[0, 255, 256]]
    tensor([127, 127,   0], dtype=torch.uint8)
    """
    numel = codes.numel()
    if scales.shape != (_blocks(numel),):
        raise ValueError(
            f"8-bit state of {numel} elements has scales of shape {tuple(scales.shape)}; expected "
            f"({_blocks(numel)},), one per {_codecs.CODEC_BLOCK} elements"
        )
    bits = scales.detach().float().view(torch.int32)
    if bool(((bits & _MANTISSA_AND_SIGN) != 0).logical_or(bits >= 0x7F800000).any()):
        raise ValueError("8-bit state scales must be 0 or finite positive powers of two (the codec's)")
    exponents = (bits >> 23).to(torch.uint8)
    per_element = exponents[:, None].expand(-1, _codecs.CODEC_BLOCK).reshape(-1)[:numel]
    out = torch.empty_like(codes, dtype=torch.uint8)
    _storage_flat(out).copy_(per_element)
    return out


def block_codes(codes: Tensor, exponents: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """The codes and float32 block scales that hold the values of ``codes`` under per-element
    scale ``exponents`` (both dense, in the same layout; the result keeps it).

    A block of 256 (in storage order) whose elements share one exponent keeps its codes as they
    are. The others take values decoded element by element, encoded again with their own block
    scale: exact for every value within the block's top 15 (signed) / 31 (unsigned) binades
    (a decoded value already has the code's 3 mantissa bits), and the codec's flush below them
    (signed: 0, unsigned: the smallest code), as any encode does.
    """
    numel = codes.numel()
    if numel == 0:
        return codes, torch.zeros(0, dtype=torch.float32, device=codes.device)
    blocks = _blocks(numel)
    flat = _storage_flat(exponents)
    padding = blocks * _codecs.CODEC_BLOCK - numel
    if padding:  # the last block's tail repeats its last element, which leaves it as uniform
        flat = torch.cat([flat, flat[-1:].expand(padding)])
    by_block = flat.view(blocks, _codecs.CODEC_BLOCK)
    first = by_block[:, 0]
    uniform = (by_block == first[:, None]).all(dim=1)
    scales = exponent_scales(first)
    if bool(uniform.all()):
        return codes, scales
    # value = relative code value * own scale (the decode of a block: one multiply by its power of
    # two), except non-finite codes, which a zero scale must not turn into NaN.
    ones = torch.ones(blocks, dtype=torch.float32, device=codes.device)
    relative = _like(_codecs.decode(codes, ones, signed), codes)
    values = torch.where(relative.isfinite(), relative * exponent_scales(exponents), relative)
    new_codes, new_scales = _codecs.encode(_like(values, codes), signed)
    new_codes = _like(new_codes, codes)
    keep = uniform[:, None].expand(-1, _codecs.CODEC_BLOCK).reshape(-1)[:numel]
    flat_codes = _storage_flat(new_codes)
    flat_codes.copy_(torch.where(keep, _storage_flat(codes), flat_codes))
    return new_codes, torch.where(uniform, scales, new_scales)


def _is_per_element(key: str) -> bool:
    return key != "step"


def dtensor_entries(saved: dict[str, Any], param: Tensor, where: str) -> dict[str, Any]:
    """The DTensor form of the state entries ``saved`` of DTensor ``param``, made from its local
    ones (plain tensors shaped like the local shard; block scales become element exponents).
    The DTensors share memory with the local tensors (scale exponents and remainders excepted),
    on their device: the CPU for FSDP2's CPU-offloaded params, whose mesh is a CUDA one."""
    local_param = param.to_local()
    entries: dict[str, Any] = {}
    for key, value in saved.items():
        if not (_is_per_element(key) and isinstance(value, Tensor)) or _dtensor.is_dtensor(value):
            entries[key] = value
            continue
        if key.endswith(_codecs.SCALES_SUFFIX):
            codes = saved.get(key.removesuffix(_codecs.SCALES_SUFFIX))
            if codes is None:
                raise ValueError(f"{where}: state {key!r} without its codes")
            value = element_exponents(codes, value)
        elif key == REMAINDER_KEY:  # gloo and NCCL have no int16 collectives (full state dicts)
            value = value.to(torch.int32)
        if value.shape != local_param.shape or not is_dense(value):
            raise ValueError(
                f"{where}: state {key!r} of shape {tuple(value.shape)} for a local shard of shape "
                f"{tuple(local_param.shape)}; expected a dense tensor shaped like the shard"
            )
        entries[key] = _dtensor.laid_out_like(value, param)
    return entries


def _placement_text(tensor: Tensor) -> str:
    return f"mesh {tensor.device_mesh}, placements {tuple(tensor.placements)}"


def local_entries(saved: dict[str, Any], param: Tensor, where: str) -> dict[str, Any]:
    """The local form of the state entries ``saved`` of ``param``: the entries of a DTensor param
    as DTensors of its mesh, placements and shape (this rank's shard taken), those of a plain
    param as plain tensors (a replicated DTensor's local copy taken); per-element scale exponents
    made into block codes and scales in the layout the param's state is stepped in.

    Raises ValueError, saying what to do, for anything else: in particular a plain tensor for a
    DTensor param, the rank-local form that cannot tell one rank's shard from another's.
    """
    is_sharded = _dtensor.is_dtensor(param)
    local_param = _dtensor.local(param)
    entries: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor) or not _is_per_element(key):
            entries[key] = _dtensor.local(value) if isinstance(value, Tensor) and value.dim() == 0 else value
            continue
        if is_sharded:
            entries[key] = _local_shard(key, value, param, where)
        elif _dtensor.is_dtensor(value):
            if not all(placement.is_replicate() for placement in value.placements):
                raise ValueError(
                    f"{where} is a plain tensor, but its state {key!r} is a DTensor "
                    f"({_placement_text(value)}) sharded over ranks. Load sharded state into a plain "
                    "model through torch.distributed.checkpoint (dcp.load + set_state_dict) or a "
                    "full state dict (get_optimizer_state_dict(..., "
                    "options=StateDictOptions(full_state_dict=True)))."
                )
            entries[key] = value.to_local()
        else:
            entries[key] = value
    for key in [key for key in entries if key.endswith(_codecs.SCALES_SUFFIX)]:
        exponents = entries[key]
        if exponents.dtype != torch.uint8:  # float32 block scales: the local form of a plain param
            continue
        base = key.removesuffix(_codecs.SCALES_SUFFIX)
        codes = entries.get(base)
        if codes is None or codes.dtype != torch.uint8 or codes.shape != exponents.shape:
            raise ValueError(
                f"{where}: state {key!r} holds per-element scale exponents of shape "
                f"{tuple(exponents.shape)} without uint8 codes of that shape under {base!r}"
            )
        if bool((exponents == 255).any()):
            raise ValueError(f"{where}: state {key!r} holds the exponent 255, which no block scale has")
        reference = local_param if is_dense(local_param) and local_param.shape == codes.shape else None
        codes = _like(codes, reference)
        entries[base], entries[key] = block_codes(
            codes, _like(exponents, codes), base in _codecs.SIGNED_STATES
        )
    return entries


def _like(tensor: Tensor, reference: Tensor | None) -> Tensor:
    """``tensor``'s values in ``reference``'s layout (contiguous without one), copied only if
    its own layout differs."""
    if reference is None:
        return tensor.contiguous()
    if tensor.stride() == reference.stride() or tensor.numel() <= 1:
        return tensor
    return torch.empty_like(reference, dtype=tensor.dtype).copy_(tensor)


def _local_shard(key: str, value: Tensor, param: Tensor, where: str) -> Tensor:
    """This rank's shard of DTensor state ``value`` for DTensor ``param``, checked to be laid out
    over the same mesh, placements and global shape."""
    if not _dtensor.is_dtensor(value):
        raise ValueError(
            f"{where} is a DTensor of global shape {tuple(param.shape)} ({_placement_text(param)}), "
            f"but its state {key!r} is a plain tensor of shape {tuple(value.shape)}: a rank-local "
            "shard, as fusedamp's state_dict() held DTensor state before, which does not say whose "
            "shard it is; not loaded. A torch.distributed.checkpoint checkpoint of that form holds "
            "one rank's shards for every rank: its optimizer state is lost (resume the model with a "
            "fresh optimizer). A state_dict that each rank saved of its own optimizer loads on the "
            "same rank and sharding through fusedamp.optim.dtensor_state_dict(optimizer, state_dict)."
        )
    if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
        raise ValueError(
            f"{where}: its state {key!r} is a DTensor on {_placement_text(value)}, the param is on "
            f"{_placement_text(param)}. Reshard through torch.distributed.checkpoint (dcp.save / "
            "dcp.load into get_state_dict's state_dict, then set_state_dict), which lays the "
            "state out like the params it loads into."
        )
    if value.shape != param.shape:
        raise ValueError(
            f"{where}: its state {key!r} has global shape {tuple(value.shape)}, the param "
            f"{tuple(param.shape)}"
        )
    local = value.to_local()
    if local.shape != param.to_local().shape:  # pragma: no cover - same mesh, placements, shape
        raise ValueError(
            f"{where}: the local shard of state {key!r} has shape {tuple(local.shape)}, the "
            f"param's {tuple(param.to_local().shape)}"
        )
    return local


def dtensor_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` in the rank-local form (plain tensors shaped like each DTensor param's local
    shard, as fusedamp's ``state_dict()`` held them before it held DTensors) made into the DTensor
    form that ``optimizer.load_state_dict`` takes; ``state_dict`` is left as it is.

    Only right for a state_dict that this very rank saved of its own optimizer (``torch.save`` on
    each rank) and that loads under the same mesh and sharding: a rank-local tensor does not say
    which shard it is. A torch.distributed.checkpoint checkpoint of that form holds one rank's
    shards for every rank: it cannot be converted.

    >>> state = torch.load(f"optim-rank{rank}.pt", weights_only=True)  # each rank its own file
    >>> opt.load_state_dict(fusedamp.optim.dtensor_state_dict(opt, state))
    """
    params = list(chain.from_iterable(group["params"] for group in optimizer.param_groups))
    saved_ids = list(chain.from_iterable(group["params"] for group in state_dict["param_groups"]))
    if len(saved_ids) != len(params):
        raise ValueError(
            f"the state_dict has {len(saved_ids)} params, the optimizer {len(params)}: it is not this "
            "optimizer's"
        )
    state = dict(state_dict["state"])
    for index, (saved_id, param) in enumerate(zip(saved_ids, params, strict=True)):
        if _dtensor.is_dtensor(param) and saved_id in state:
            where = f"param {index} (saved as {saved_id!r})"
            state[saved_id] = dtensor_entries(state[saved_id], param, where)
    return {**state_dict, "state": state}

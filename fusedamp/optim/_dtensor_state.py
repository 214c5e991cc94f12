"""The form a DTensor param's optimizer state takes in ``state_dict()`` (docs/distributed-checkpoint.md).

An optimizer keeps the state of a DTensor param (FSDP2's ``fully_shard``, tensor parallel) as
plain tensors made like its local shard, which the kernels step. ``state_dict()`` hands every
per-element entry (moments in their codec, fp32 masters, bf16 remainders) out as a DTensor with
the param's device mesh, placements, global shape and stride, as torch.optim's own optimizers
hold it, so that ``torch.distributed.checkpoint`` saves each element once and reshards it for
another world size; ``step`` stays a plain 0-dim tensor. ``load_state_dict`` takes the local
shard back (:func:`local_entries`).

The bfloat16 scales of 8-bit moments are one per 256 elements of a rank's *local* storage, a
layout that depends on the sharding. In the DTensor form, ``<key>_scales`` is instead a bfloat16
DTensor shaped like the param holding each element's block scale (the scale with its form's flag,
[note: block codes] in csrc/include/fusedamp/math/codec.h), so that it reshards elementwise with
the codes. On load, a local block whose elements all carry one scale keeps its codes bitwise; any
other block (the checkpoint was written under another sharding) is decoded element by element and
encoded again. A uint8 form (each element's power-of-two scale as its float32 exponent) is that of
earlier fusedamp builds, whose codes are decoded the same way and encoded in the current ones.
The int16 remainders of bf16 masters are int32 in the DTensor form: gloo and NCCL have no int16
collectives, which full state dicts (gathered DTensors) need.
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from fusedamp import _dtensor
from fusedamp._layout import is_dense
from fusedamp.optim import _codecs
from fusedamp.optim._masters import REMAINDER_KEY

__all__ = [
    "block_codes", "dtensor_entries", "dtensor_state_dict", "element_scales", "local_entries",
]


def _storage_flat(tensor: Tensor) -> Tensor:
    """A 1-D view of a dense ``tensor``'s elements in the order its storage holds them (the
    order the kernels and the codec's blocks walk)."""
    return tensor.as_strided((tensor.numel(),), (1,))


def _blocks(numel: int) -> int:
    return (numel + _codecs.CODEC_BLOCK - 1) // _codecs.CODEC_BLOCK


def element_scales(codes: Tensor, scales: Tensor) -> Tensor:
    """Each element's block scale: a bfloat16 tensor shaped and laid out like ``codes`` (dense),
    from the bfloat16 ``scales`` of its blocks of 256 in storage order.

    >>> codes, scales = torch.zeros(300, dtype=torch.uint8), torch.tensor([1.0, 0.0]).bfloat16()
    >>> element_scales(codes, scales)[[0, 255, 256]]
    tensor([1., 1., 0.], dtype=torch.bfloat16)
    """
    numel = codes.numel()
    if scales.shape != (_blocks(numel),) or scales.dtype != _codecs.SCALE_DTYPE:
        raise ValueError(
            f"8-bit state of {numel} elements has scales of dtype {scales.dtype} and shape "
            f"{tuple(scales.shape)}; expected bfloat16 of shape ({_blocks(numel)},), one per "
            f"{_codecs.CODEC_BLOCK} elements"
        )
    per_element = scales[:, None].expand(-1, _codecs.CODEC_BLOCK).reshape(-1)[:numel]
    out = torch.empty_like(codes, dtype=_codecs.SCALE_DTYPE)
    _storage_flat(out).copy_(per_element)
    return out


def _relative_values(signed: bool) -> Tensor:
    """decode_state of every code under the unit scale of each form: (2 forms, 256 codes)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    unit = torch.tensor([1.0], dtype=_codecs.SCALE_DTYPE)
    wide = (unit.view(torch.int16) | -0x8000).view(_codecs.SCALE_DTYPE)  # the sign bit: the wide form
    return torch.stack([_codecs.decode(codes, scale, signed) for scale in (unit, wide)])


def _element_values(codes: Tensor, scales: Tensor, signed: bool) -> Tensor:
    """decode_state with a scale per element (``scales`` laid out like ``codes``): each code's
    value under its form times its scale, the product the kernels round."""
    flat_scales = _storage_flat(scales)
    wide = (flat_scales.view(torch.int16) < 0).long()
    relative = _relative_values(signed).to(codes.device)[wide, _storage_flat(codes).long()]
    values = torch.empty_like(codes, dtype=torch.float32)
    _storage_flat(values).copy_(relative * flat_scales.abs().float())
    return values


def block_codes(codes: Tensor, scales: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """The codes and bfloat16 block scales that hold the values of ``codes`` under per-element
    ``scales`` (both dense, in the same layout; the result keeps it): bfloat16 block scales, or
    the uint8 exponents of earlier builds' power-of-two scales.

    A block of 256 (in storage order) whose elements share one bfloat16 scale keeps its codes as
    they are. The others take values decoded element by element, encoded again in their own
    block (rounded to nearest).
    """
    numel = codes.numel()
    if numel == 0:
        return codes, torch.zeros(0, dtype=_codecs.SCALE_DTYPE, device=codes.device)
    if scales.dtype == torch.uint8:  # earlier builds: every block encoded again
        values = _codecs.decode_earlier(codes, (scales.to(torch.int32) << 23).view(torch.float32), signed)
        new_codes, new_scales = _codecs.encode(values, signed)
        return _like(new_codes, codes), new_scales
    blocks = _blocks(numel)
    flat = _storage_flat(scales).view(torch.int16)
    padding = blocks * _codecs.CODEC_BLOCK - numel
    if padding:  # the last block's tail repeats its last element, which leaves it as uniform
        flat = torch.cat([flat, flat[-1:].expand(padding)])
    by_block = flat.view(blocks, _codecs.CODEC_BLOCK)
    first = by_block[:, 0].clone(memory_format=torch.contiguous_format)
    uniform = (by_block == first[:, None]).all(dim=1)
    block_scales = first.view(_codecs.SCALE_DTYPE)
    if bool(uniform.all()):
        return codes, block_scales
    values = _element_values(codes, scales, signed)
    new_codes, new_scales = _codecs.encode(_like(values, codes), signed)
    new_codes = _like(new_codes, codes)
    keep = uniform[:, None].expand(-1, _codecs.CODEC_BLOCK).reshape(-1)[:numel]
    flat_codes = _storage_flat(new_codes)
    flat_codes.copy_(torch.where(keep, _storage_flat(codes), flat_codes))
    return new_codes, torch.where(uniform, block_scales, new_scales)


def _is_per_element(key: str) -> bool:
    return key != "step"


def dtensor_entries(saved: dict[str, Any], param: Tensor, where: str) -> dict[str, Any]:
    """The DTensor form of the state entries ``saved`` of DTensor ``param``, made from its local
    ones (plain tensors shaped like the local shard; block scales become element scales).
    The DTensors share memory with the local tensors (element scales and remainders excepted),
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
            value = element_scales(codes, value)
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
    param as plain tensors (a replicated DTensor's local copy taken); per-element scales made into
    block codes and scales in the layout the param's state is stepped in.

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
        scales = entries[key]
        base = key.removesuffix(_codecs.SCALES_SUFFIX)
        codes = entries.get(base)
        # Block scales (the local form of a plain param) are 1-D, one per block: shaped like the
        # codes only when there is one element, where both forms are the same.
        per_element = scales.dtype == torch.uint8 or (codes is not None and scales.shape == codes.shape)
        if not per_element:
            continue
        if codes is None or codes.dtype != torch.uint8 or codes.shape != scales.shape:
            raise ValueError(
                f"{where}: state {key!r} holds per-element scales of shape {tuple(scales.shape)} "
                f"without uint8 codes of that shape under {base!r}"
            )
        if scales.dtype == torch.uint8:
            if bool((scales == 255).any()):
                raise ValueError(f"{where}: state {key!r} holds the exponent 255, which no block scale has")
            warnings.warn(
                f"{where}: state {base!r} holds the 8-bit codes of an earlier fusedamp build (per-element "
                "scale exponents); converted to the current codes (decoded exactly, encoded again to "
                "nearest). Save the checkpoint again to keep it in the current format.",
                stacklevel=3,
            )
        elif scales.dtype != _codecs.SCALE_DTYPE:
            raise ValueError(
                f"{where}: state {key!r} holds per-element scales of dtype {scales.dtype}; expected bfloat16"
            )
        reference = local_param if is_dense(local_param) and local_param.shape == codes.shape else None
        codes = _like(codes, reference)
        entries[base], entries[key] = block_codes(codes, _like(scales, codes), base in _codecs.SIGNED_STATES)
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

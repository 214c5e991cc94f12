"""DTensor (FSDP2, ``torch.distributed.fsdp.fully_shard``) support shared by the GradScaler and
the optimizers.

fusedamp's ops have no sharding rules: they run on each rank's local shard of a DTensor param
and grad (elementwise updates need nothing else). What does need the other ranks is a value
reduced over all elements: found_inf, summed over every process group of the DTensors' device
meshes so that every rank sees it, and the sum of squares of a clipping norm, summed only over
the mesh dimensions that split a grad's elements (Shard) or its values (Partial): a Replicate
dimension (HSDP's replica groups, a tensor-parallel Replicate() param) holds the same elements
on each of its ranks, which must count once.

Those sums are 0-dim tensors on the grads' device, which is the CPU for FSDP2 with
``CPUOffloadPolicy`` while its process group may have no CPU backend (NCCL only), on which
``all_reduce`` of a CPU tensor fails (torch's ``clip_grad_norm_`` does: pytorch issue 148532).
:func:`reduction_device` says where such a sum is reduced instead; :func:`sum_over_groups_` moves
it there and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_reduce_sum_", "has_backend_for", "is_dtensor", "laid_out_like", "local", "meshes_of",
    "norm_groups", "reduction_device", "sum_over_dims_", "sum_over_groups_",
]

if dist.is_available():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
else:  # pragma: no cover - torch built without distributed support
    DeviceMesh = DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (False when torch has no distributed support)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor (aliasing its storage: in-place ops update the DTensor),
    or ``tensor`` itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def laid_out_like(local_tensor: Tensor, param: Tensor) -> Tensor:
    """A DTensor of ``local_tensor`` (this rank's shard, shaped like ``param``'s) with DTensor
    ``param``'s mesh, placements, global shape and stride, sharing ``local_tensor``'s memory on
    its own device.

    Made as FSDP2 makes its sharded params: ``DTensor.from_local`` would move the shard to the
    mesh's device type, which for FSDP2's CPU-offloaded params (a CUDA mesh, CPU shards) is a
    copy of the optimizer state on the GPU.
    """
    spec = param._spec
    meta = spec.tensor_meta._replace(dtype=local_tensor.dtype)
    return DTensor(local_tensor, dataclasses.replace(spec, tensor_meta=meta), requires_grad=False)


def meshes_of(tensors: Iterable[Tensor]) -> list[DeviceMesh]:
    """The distinct device meshes of the DTensors among ``tensors``, in first-seen order."""
    meshes: list[DeviceMesh] = []
    for tensor in tensors:
        if is_dtensor(tensor) and tensor.device_mesh not in meshes:
            meshes.append(tensor.device_mesh)
    return meshes


def has_backend_for(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether ``group`` runs collectives on tensors of ``device_type`` ("cpu", "cuda"): gloo
    and ``"cpu:gloo,cuda:nccl"`` groups do on the CPU, NCCL-only ones do not."""
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:  # not a c10d ProcessGroup: nothing to ask, trust the tensor's device
        return True
    try:
        get_backend(torch.device(device_type))
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    return True


def reduction_device(device: torch.device, groups: Iterable[dist.ProcessGroup]) -> torch.device:
    """Where a small tensor on ``device`` is all-reduced over ``groups``: on ``device`` when every
    group has a backend for its type; else on the CPU when they all have a CPU backend (CUDA
    tensors over a gloo-only group); else, for CPU tensors (FSDP2's CPU-offloaded shards under
    NCCL), on the current CUDA device.

    >>> reduction_device(torch.device("cpu"), [nccl_group])
    device(type='cuda', index=0)
    """
    groups = list(groups)
    if all(has_backend_for(group, device.type) for group in groups):
        return device
    if device.type != "cpu" and all(has_backend_for(group, "cpu") for group in groups):
        return torch.device("cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(
        f"fusedamp cannot all-reduce a {device.type} tensor over a process group without a "
        f"{device.type} backend: CPU tensors over an NCCL-only group go through the current CUDA "
        "device, and CUDA is not available"
    )


def sum_over_groups_(tensor: Tensor, groups: Iterable[dist.ProcessGroup]) -> None:
    """Sums ``tensor`` in place over each of ``groups`` in turn, on :func:`reduction_device`: a
    copy there and back when that is another device (the copy back to the CPU waits for the sum).
    Else asynchronous on the device with NCCL: no host sync."""
    groups = list(groups)
    if not groups:
        return
    device = reduction_device(tensor.device, groups)
    work = tensor if device == tensor.device else tensor.to(device)
    for group in groups:
        dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    if work is not tensor:
        tensor.copy_(work)


def all_reduce_sum_(tensor: Tensor, meshes: Iterable[DeviceMesh]) -> None:
    """Sums ``tensor`` in place over every rank of ``meshes`` (each mesh dimension's group once,
    which covers the mesh), through :func:`sum_over_groups_`."""
    sum_over_groups_(tensor, [mesh.get_group(dim) for mesh in meshes for dim in range(mesh.ndim)])


def norm_groups(tensors: Iterable[Tensor]) -> list[tuple[DeviceMesh, tuple[int, ...], list[Tensor]]]:
    """DTensors grouped by (device mesh, the mesh dims a sum of their elements reduces over: those
    whose placement is not Replicate), in first-seen order."""
    groups: list[tuple[DeviceMesh, tuple[int, ...], list[Tensor]]] = []
    for tensor in tensors:
        mesh = tensor.device_mesh
        dims = tuple(dim for dim, placement in enumerate(tensor.placements) if not placement.is_replicate())
        for group_mesh, group_dims, members in groups:
            if group_mesh == mesh and group_dims == dims:
                members.append(tensor)
                break
        else:
            groups.append((mesh, dims, [tensor]))
    return groups


def sum_over_dims_(tensor: Tensor, mesh: DeviceMesh, dims: Iterable[int]) -> None:
    """Sums ``tensor`` in place over the process groups of ``mesh``'s dimensions ``dims``,
    through :func:`sum_over_groups_`."""
    sum_over_groups_(tensor, [mesh.get_group(dim) for dim in dims])

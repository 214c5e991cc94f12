"""DTensor (FSDP2, ``torch.distributed.fsdp.fully_shard``) support shared by the GradScaler and
the optimizers.

fusedamp's ops have no sharding rules: they run on each rank's local shard of a DTensor param
and grad (elementwise updates need nothing else). What does need the other ranks is a value
reduced over all elements: found_inf, summed over every process group of the DTensors' device
meshes so that every rank sees it, and the sum of squares of a clipping norm, summed only over
the mesh dimensions that split a grad's elements (Shard) or its values (Partial): a Replicate
dimension (HSDP's replica groups, a tensor-parallel Replicate() param) holds the same elements
on each of its ranks, which must count once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_sum_", "is_dtensor", "local", "meshes_of", "norm_groups", "sum_over_dims_"]

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


def meshes_of(tensors: Iterable[Tensor]) -> list[DeviceMesh]:
    """The distinct device meshes of the DTensors among ``tensors``, in first-seen order."""
    meshes: list[DeviceMesh] = []
    for tensor in tensors:
        if is_dtensor(tensor) and tensor.device_mesh not in meshes:
            meshes.append(tensor.device_mesh)
    return meshes


def all_reduce_sum_(tensor: Tensor, meshes: Iterable[DeviceMesh]) -> None:
    """Sums ``tensor`` in place over every rank of ``meshes`` (each mesh dimension's group once,
    which covers the mesh). Asynchronous on the device with NCCL: no host sync."""
    for mesh in meshes:
        for dim in range(mesh.ndim):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))


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
    """Sums ``tensor`` in place over the process groups of ``mesh``'s dimensions ``dims``.
    Asynchronous on the device with NCCL: no host sync."""
    for dim in dims:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))

"""Host buffers of an offloaded optimizer: the host copies of its params and its host grads, carved
out of few allocations that start on a page and are page-locked with ``cudaHostRegister`` when they
are copied to and from a GPU (torch's pinned allocator would round each block up to a power of
two). The optimizer state is ordinary host memory: it never travels."""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from fusedamp._layout import is_dense

# Every host buffer starts on a cache line; each allocation on a page (cudaHostRegister pins pages).
_ALIGN = 64
_PAGE = 4096

# (shape, strides, dtype) of one host buffer.
Spec = tuple[torch.Size, tuple[int, ...], torch.dtype]


def host_layout(param: Tensor) -> tuple[torch.Size, tuple[int, ...]]:
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


class HostBuffers:
    """Host tensors carved out of few allocations, page-locked (``cudaHostRegister``) when they
    are copied to and from a GPU; ``blocks`` are the allocations, ``registered`` their pinned
    addresses (both released by ``release``).

    >>> buffers = HostBuffers(pin=False)
    >>> host, grad = buffers.allocate([(torch.Size([4, 3]), (3, 1), torch.bfloat16)] * 2)
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.blocks: list[Tensor] = []
        self.registered: list[int] = []

    def allocate(self, specs: Sequence[Spec]) -> list[Tensor]:
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

    def allocated_bytes(self) -> int:
        return sum(block.numel() for block in self.blocks)

    def _register(self, block: Tensor) -> None:
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(block.data_ptr(), block.numel(), 1)  # cudaHostRegisterPortable
        if int(result) != 0:
            warnings.warn(
                f"fusedamp offload: cudaHostRegister of {block.numel()} bytes failed "
                f"({cudart.cudaGetErrorString(result)}); the copies of these buffers will not overlap "
                "with compute (raise the locked-memory limit, ulimit -l)",
                stacklevel=5,
            )
            return
        self.registered.append(block.data_ptr())


def release(registered: list[int], blocks: list[Tensor]) -> None:
    """Unpins and drops the allocations of a HostBuffers (once no copy can still use them)."""
    if registered:
        torch.cuda.synchronize()  # no copy may still read or write the memory unpinned below
        cudart = torch.cuda.cudart()
        for pointer in registered:
            cudart.cudaHostUnregister(pointer)
    registered.clear()
    blocks.clear()

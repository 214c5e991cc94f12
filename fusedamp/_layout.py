"""Which tensors the fused kernels take as they are, and the views or copies that make the rest fit.

The kernels walk memory linearly ([note: dense layouts] in csrc/common/inputs.cpp), so they take
any layout without gaps or overlaps (contiguous, channels_last, any permutation of the dims) in
float32, float16 or bfloat16. Complex tensors are handed over as their real view (pairs of
reals), as torch.optim treats them; other dtypes (float64) take torch's own ops instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_dense(tensor: Tensor) -> bool:
    """Whether ``tensor`` fills one block of memory without gaps or overlaps, in any dim order.

    >>> is_dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    True
    >>> is_dense(torch.zeros(4, 6)[:, ::2])
    False
    """
    if tensor.is_contiguous() or tensor.numel() == 0:
        return True
    expected = 1
    dims = [(size, stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1]
    for size, stride in sorted(dims, key=lambda dim: dim[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def same_order(tensor: Tensor, reference: Tensor) -> bool:
    """Whether ``tensor`` stores its elements in the order of ``reference`` (same shape, and the
    same strides on every dim longer than 1), so a kernel may walk both side by side."""
    if tensor.is_contiguous() and reference.is_contiguous():
        return tensor.numel() == reference.numel()
    if tensor.shape != reference.shape:
        return False
    return all(
        size == 1 or a == b
        for size, a, b in zip(tensor.shape, tensor.stride(), reference.stride(), strict=True)
    )


def like(tensor: Tensor, reference: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A copy of ``tensor``'s values in ``reference``'s memory format (and ``dtype``, if given)."""
    out = torch.empty_like(reference, dtype=dtype or tensor.dtype)
    return out.copy_(tensor)


def real_view(tensor: Tensor) -> Tensor:
    """A complex tensor as pairs of reals (as torch.optim steps complex params); others as they are."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def has_kernel(dtype: torch.dtype) -> bool:
    """Whether fusedamp's fused kernels take tensors of ``dtype`` (complex ones as their
    :func:`real_view`)."""
    return (dtype.to_real() if dtype.is_complex else dtype) in KERNEL_DTYPES

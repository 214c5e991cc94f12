"""Routes torch's F.linear and matmul on half-precision tensors through fusedamp's GEMM."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from fusedamp import ops
from fusedamp.nn.linear import HALF_DTYPES, compute_dtype

_MATMULS = (torch.matmul, Tensor.matmul, Tensor.__matmul__)
# fusedamp's GEMM kernels need sm_80 (mma.sync; wgmma on sm_90a). Below it ops.gemm could only run
# its fp32 ATen reference, slower than torch's own half-precision GEMM on Turing's Tensor Cores,
# so the routing leaves those GPUs' calls to torch.
_MIN_CAPABILITY = (8, 0)


def _has_gemm_kernels(device: torch.device) -> bool:
    """Whether fusedamp's GEMM kernels can run on ``device`` (any non-CUDA device: the op's own
    implementation for it)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= _MIN_CAPABILITY


class _GemmRouting(TorchFunctionMode):
    def __init__(self, device_types: tuple[str, ...]) -> None:
        super().__init__()
        self.device_types = device_types

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            routed = self._linear(*args, **kwargs)
        elif func in _MATMULS and not kwargs:
            routed = self._matmul(*args)
        else:
            routed = None
        return func(*args, **kwargs) if routed is None else routed

    def _dtype_for(self, *tensors: Tensor | None) -> torch.dtype | None:
        """The half dtype to compute in, or None when the call is not ours to take."""
        present = [t for t in tensors if t is not None]
        if not all(isinstance(t, Tensor) for t in present):
            return None
        first = present[0]
        if first.device.type not in self.device_types or not _has_gemm_kernels(first.device):
            return None
        if any(t.device != first.device or not t.is_floating_point() for t in present):
            return None
        dtype = compute_dtype(first)
        if dtype not in HALF_DTYPES or any(
            t.dtype != dtype and compute_dtype(t) != dtype for t in present
        ):
            return None
        return dtype

    def _linear(self, x: Any, weight: Any, bias: Any = None) -> Tensor | None:
        dtype = self._dtype_for(x, weight, bias)
        if dtype is None or weight.dim() != 2 or x.dim() < 1:
            return None
        b = None if bias is None else bias.to(dtype)
        return ops.gemm(x.to(dtype), weight.to(dtype).t(), b)

    def _matmul(self, a: Any, b: Any) -> Tensor | None:
        dtype = self._dtype_for(a, b)
        if dtype is None or a.dim() < 2 or b.dim() != 2:
            return None
        return ops.gemm(a.to(dtype), b.to(dtype))


@contextmanager
def fused_gemm_routing(device_types: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Inside the block, ``F.linear(x, W, b)`` and ``torch.matmul(a, b)`` / ``a @ b`` with a 2-D
    ``b`` run on :func:`fusedamp.ops.gemm` when their tensors are on one of ``device_types`` and
    compute in float16/bfloat16 (half tensors, or float tensors under autocast to a half dtype).
    Everything else goes to torch unchanged, calls on a GPU older than sm_80 (Turing and before,
    which fusedamp's GEMM kernels do not run on) included. Results are in the half dtype, as under
    autocast.

    >>> with fusedamp.nn.fused_gemm_routing(), torch.autocast("cuda", dtype=torch.bfloat16):
    ...     y = model(x)
    """
    with _GemmRouting(tuple(device_types)):
        yield

"""fusedamp: fused mixed-precision training for PyTorch (CPU and CUDA).

Drop-in replacements for ``torch.autocast``, ``torch.amp.GradScaler`` and
``torch.optim.AdamW`` / ``SGD`` with fp32 master weights and the unscale, inf-check and
clipping folded into one fused optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from fusedamp import _C, diagnostics, nn, ops
from fusedamp.autocast import autocast
from fusedamp.grad_scaler import GradScaler
from fusedamp.optim import FusedAdamW, FusedMuon, FusedSGD
from fusedamp.precision import half_model

# The package version, read by the build from here (pyproject.toml: dynamic = ["version"]).
__version__ = "0.1.0"

__all__ = [
    "__version__",
    "FusedAdamW",
    "FusedMuon",
    "FusedSGD",
    "GradScaler",
    "autocast",
    "build_info",
    "diagnostics",
    "half_model",
    "nn",
    "ops",
]


def build_info() -> dict[str, Any]:
    """How this copy of fusedamp was built and what it uses at run time.

    >>> fusedamp.build_info()["cpu_isa"]
    'avx512'
    """
    from fusedamp import _build_meta, _cuda_archs

    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("fusedamp::unscale_", "CUDA")
    cuda_compiled = bool(_C.cuda_compiled and has_cuda_kernel)
    return {
        "torch_built_against": _build_meta.TORCH_VERSION,
        "torch_running": torch.__version__,
        "cuda_compiled": cuda_compiled,
        "cuda_archs": _build_meta.CUDA_ARCHS.split(";") if _build_meta.CUDA_ARCHS else [],
        # The CUDA GEMM kernels with code in this build (the ATen reference path is always there).
        "gemm_kernels": _cuda_archs.gemm_kernels(_build_meta.CUDA_ARCHS) if cuda_compiled else [],
        "cpu_isa": _C.cpu_isa(),
        # The CPU kernel builds compiled in (setup.py's FUSEDAMP_CPU_ISAS).
        "cpu_isas_built": list(_build_meta.CPU_ISAS),
        # Threads the CPU ops really use: torch.get_num_threads() unless OpenMP was lost.
        "cpu_threads": _C.parallel_for_threads(),
        # The L3 this CPU's cores share (csrc/cpu/isa.h).
        "cpu_cache_bytes": _C.last_level_cache_bytes(),
    }

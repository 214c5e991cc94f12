"""Modules backed by fusedamp's fused kernels, and the routing of torch's linear/matmul to them."""

from __future__ import annotations

from fusedamp.nn.linear import Linear
from fusedamp.nn.routing import fused_gemm_routing

__all__ = ["Linear", "fused_gemm_routing"]

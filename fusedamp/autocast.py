"""Mixed-precision regions, drop-in for ``torch.autocast``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from fusedamp.nn.routing import fused_gemm_routing

__all__ = ["autocast"]


class autocast(torch.autocast):
    """A region (context manager or decorator) where eligible ops run in ``dtype``: exactly
    ``torch.autocast``, which it subclasses, so ``torch.compile`` traces it the same way.

    ``fused_gemm=True`` also routes ``F.linear`` / ``torch.matmul`` inside the region through
    :func:`fusedamp.ops.gemm` (fp32 accumulation, fused bias and activation epilogue) on this
    device type; see :func:`fusedamp.nn.fused_gemm_routing`. It is off by default.

    ``dtype`` defaults to the device's autocast dtype, float16 on ``"cuda"`` and bfloat16 on
    ``"cpu"`` (``torch.get_autocast_dtype``). Asked for ``"cuda"`` without a GPU, it warns and
    disables itself, as torch does.

    Example::

        model = torch.nn.Linear(8, 8)
        with fusedamp.autocast("cpu"):
            out = model(torch.randn(4, 8))  # out.dtype == torch.bfloat16

        @fusedamp.autocast("cuda", dtype=torch.bfloat16)
        def forward(x):
            return model(x)
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        fused_gemm: bool = False,
    ) -> None:
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        self.fused_gemm = fused_gemm
        self._routing: AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        super().__enter__()
        if self.fused_gemm and self._enabled:
            self._routing = fused_gemm_routing((self.device,))
            self._routing.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        if self._routing is not None:
            routing, self._routing = self._routing, None
            routing.__exit__(*exc_info)
        super().__exit__(*exc_info)

"""Mixed-precision regions, drop-in for ``torch.autocast``."""

from __future__ import annotations

import torch

__all__ = ["autocast"]


class autocast(torch.autocast):
    """A region (context manager or decorator) where eligible ops run in ``dtype``: exactly
    ``torch.autocast``, which it subclasses, so ``torch.compile`` traces it the same way.

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


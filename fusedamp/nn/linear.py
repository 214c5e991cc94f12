"""fusedamp.nn.Linear: nn.Linear whose half-precision forward and backward run fusedamp's GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusedamp import ops

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear layer computes in: autocast's, when autocast is on for x's device and x
    is floating point, else x's own."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class Linear(nn.Linear):
    """Drop-in :class:`torch.nn.Linear` with an optional fused activation.

    In float16/bfloat16 (half inputs, or autocast to a half dtype) ``y = act(x @ W.T + b)`` is one
    :func:`fusedamp.ops.gemm` call with the bias and activation in its epilogue, and the backward
    is two more gemms; a fused GELU keeps its pre-activation from the forward pass. Other dtypes
    use ``F.linear`` and the torch activation. Parameters and ``state_dict`` match ``nn.Linear``.

    >>> layer = fusedamp.nn.Linear(1024, 4096, activation="gelu").cuda().half()
    >>> y = layer(torch.randn(8, 1024, device="cuda", dtype=torch.half))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        activation: str = "none",
    ) -> None:
        if activation not in ops.GEMM_ACTIVATIONS:
            raise ValueError(
                f"fusedamp.nn.Linear: activation must be one of {ops.GEMM_ACTIVATIONS}, "
                f"got {activation!r}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x)
        if dtype not in HALF_DTYPES:
            return _torch_activation(F.linear(x, self.weight, self.bias), self.activation)
        weight = self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.activation != "none" and torch.is_grad_enabled():
            return ops.gemm_with_preactivation(x.to(dtype), weight.t(), bias, self.activation)[0]
        return ops.gemm(x.to(dtype), weight.t(), bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"


def _torch_activation(y: Tensor, activation: str) -> Tensor:
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return y

"""O2-style mixed precision: convert a model to fp16/bf16 except its normalization layers.

Under ``autocast`` (O1) the weights stay fp32 and every op casts them again; an O2 model keeps
its weights in half precision, halving weight and gradient memory, while normalization layers
keep fp32 parameters and statistics (their reductions need the range and precision). Pair it
with an optimizer that keeps fp32 master weights, e.g. ``fusedamp.FusedAdamW(...,
master_weights=True)``: half-precision weights cannot absorb small updates themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NORM_LAYERS", "half_model"]

# BatchNorm runs natively on half inputs with fp32 parameters (CPU and cuDNN kernels). The
# other norms get their input cast to fp32 and their output cast back (see _FloatIO).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
OTHER_NORMS = (
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)
NORM_LAYERS = BATCH_NORMS + OTHER_NORMS


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floats(item, dtype) for item in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return {key: _cast_floats(item, dtype) for key, item in value.items()}
    return value


class _CastInputs:
    """Forward pre-hook: floating-point inputs (positional and keyword) to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)


class _CastOutputs:
    """Forward hook: floating-point outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floats(output, self.dtype)


class _FloatIO:
    """Pre- and post-hook pair: run the module in fp32, hand back the caller's dtype."""

    def __init__(self) -> None:
        self.input_dtype: torch.dtype | None = None

    def before(self, module: nn.Module, args: tuple) -> tuple:
        first = next((a for a in args if isinstance(a, Tensor) and a.is_floating_point()), None)
        self.input_dtype = first.dtype if first is not None else None
        return _cast_floats(args, torch.float32)

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return output if self.input_dtype is None else _cast_floats(output, self.input_dtype)


def _convert_own_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    # In place (.data), so parameters keep their identity; grads follow their parameter.
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer.is_floating_point():
            setattr(module, name, buffer.to(dtype))


def half_model(
    model: nn.Module,
    dtype: torch.dtype = torch.float16,
    keep_norm_fp32: bool = True,
    cast_inputs: bool = True,
    cast_outputs: bool = True,
) -> nn.Module:
    """Converts ``model`` in place to ``dtype`` (O2 mixed precision) and returns it.

    - Parameters and buffers of every module become ``dtype``, except those of normalization
      layers (:data:`NORM_LAYERS`) when ``keep_norm_fp32``; norms other than BatchNorm run in
      fp32 with their input and output cast around them.
    - ``cast_inputs``: floating-point inputs of ``model`` are cast to ``dtype`` on the way in.
    - ``cast_outputs``: floating-point outputs come back as fp32, so the loss is computed in
      fp32.

    Call it before creating the optimizer, and give the optimizer fp32 master weights.

    >>> model = half_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    >>> model[0].weight.dtype, model[1].weight.dtype, model(torch.randn(2, 4)).dtype
    (torch.float16, torch.float32, torch.float32)
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"half_model: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    for module in model.modules():
        if keep_norm_fp32 and isinstance(module, NORM_LAYERS):
            _convert_own_tensors(module, torch.float32)
            if isinstance(module, OTHER_NORMS):
                io = _FloatIO()
                module.register_forward_pre_hook(io.before)
                module.register_forward_hook(io.after)
        else:
            _convert_own_tensors(module, dtype)
    if cast_inputs:
        model.register_forward_pre_hook(_CastInputs(dtype), with_kwargs=True)
    if cast_outputs:
        model.register_forward_hook(_CastOutputs(torch.float32))
    return model

"""Python entry points of the fused kernels: thin wrappers over ``torch.ops.fusedamp.*``.

Every op mutates its arguments in place and returns nothing, so their fake (meta) kernels are
trivial and ``torch.compile`` can trace through them. All ops run on CPU and, when the CUDA
kernels were compiled, on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fusedamp import _C  # importing the extension registers torch.ops.fusedamp
from fusedamp._layout import has_kernel, is_dense, real_view

__all__ = [
    "unscale_", "check_and_norm_", "update_scale_", "adamw_", "sgd_", "muon_momentum_", "encode_state",
    "decode_state",
]


def unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad; sets ``found_inf`` to 1 if any grad was non-finite.

    Grads may mix dtypes and memory formats: float32, float16 and bfloat16 (and complex64 as
    pairs of float32) go through one fused kernel, float64 and complex128 through torch's own
    ``_amp_foreach_non_finite_check_and_unscale_``; a grad with gaps in memory (a strided view)
    through a contiguous copy written back. ``found_inf`` and ``inv_scale`` are float32
    one-element tensors on the grads' device; ``found_inf`` is left as it was when all are finite.
    """
    if _fit_kernels(grads):
        torch.ops.fusedamp.unscale_(grads, found_inf, inv_scale)
        return
    fused, other, write_backs = _split_by_kernel(grads, "unscale_")
    torch.ops.fusedamp.unscale_(fused, found_inf, inv_scale)
    if other:
        torch._amp_foreach_non_finite_check_and_unscale_(other, found_inf, inv_scale)
    for grad, unscaled in write_backs:
        grad.copy_(unscaled)


def check_and_norm_(
    grads: list[Tensor],
    found_inf: Tensor,
    sum_of_squares: Tensor | None = None,
    inv_scale: Tensor | None = None,
) -> None:
    """Read-only pass: sets ``found_inf`` like :func:`unscale_` and, when ``sum_of_squares`` is
    given, adds ``sum((g * inv_scale) ** 2)`` over every element of every grad to it.

    Grads of dtypes without a fused kernel (float64, complex128) are checked with torch ops.
    """
    if _fit_kernels(grads):
        torch.ops.fusedamp.check_and_norm_(grads, found_inf, sum_of_squares, inv_scale)
        return
    fused, other, _ = _split_by_kernel(grads, "check_and_norm_")
    torch.ops.fusedamp.check_and_norm_(fused, found_inf, sum_of_squares, inv_scale)
    for grad in other:
        found_inf.masked_fill_(~grad.isfinite().all(), 1.0)
        if sum_of_squares is not None:
            unscaled = grad if inv_scale is None else grad * inv_scale
            sum_of_squares.add_(unscaled.square().sum())


def _fit_kernels(grads: list[Tensor]) -> bool:
    """Whether the fused kernels take ``grads`` as they are (the usual case), found without a
    Python loop over them; under torch.compile the split below is traced instead."""
    return not torch.compiler.is_compiling() and _C.grads_fit_kernels(grads)


def _split_by_kernel(
    grads: list[Tensor], op: str
) -> tuple[list[Tensor], list[Tensor], list[tuple[Tensor, Tensor]]]:
    """(what the fused kernels take, the rest, (grad, dense copy) pairs): complex grads as
    their real views, grads with gaps in memory as contiguous copies."""
    fused: list[Tensor] = []
    other: list[Tensor] = []
    write_backs: list[tuple[Tensor, Tensor]] = []
    for index, grad in enumerate(grads):
        if not (grad.is_floating_point() or grad.is_complex()):
            raise TypeError(
                f"fusedamp: {op}: grads[{index}] has dtype {grad.dtype}; expected a floating point "
                "or complex dtype"
            )
        if grad.layout != torch.strided:
            raise TypeError(
                f"fusedamp: {op}: grads[{index}] has layout {grad.layout}; pass dense (strided) "
                "tensors (for sparse grads, their ._values())"
            )
        dense = grad
        if not is_dense(grad):
            dense = grad.contiguous()
            write_backs.append((grad, dense))
        (fused if has_kernel(grad.dtype) else other).append(real_view(dense))
    return fused, other, write_backs


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: float = float("inf"),
) -> None:
    """Dynamic loss-scale update on the device (torch's rule, plus hysteresis and bounds).

    On ``found_inf != 0`` (any value but 0, NaN and negative ones included: it may be a sum
    over devices, see [note: found_inf] in csrc/include/fusedamp/math/scale.h): the growth
    tracker resets, one unit of hysteresis is spent, and once none is left the scale is
    multiplied by ``backoff_factor`` (not below ``min_scale``). After ``growth_interval`` clean
    steps the scale is multiplied by ``growth_factor`` (not above
    ``max_scale``, never to inf) and the hysteresis is refilled.
    """
    torch.ops.fusedamp.update_scale_(
        scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
        growth_interval, hysteresis, min_scale, max_scale,
    )


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
    inv_grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    clip_coef: Tensor | None = None,
    write_unscaled_grads: bool = True,
    exp_avg_scales: list[Tensor] | None = None,
    exp_avg_sq_scales: list[Tensor] | None = None,
    max_exp_avg_sq_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
    stochastic_params: bool = False,
) -> None:
    """One fused AdamW step over same-dtype, same-device lists (see csrc/registration.cpp).

    Moments may be float32, bfloat16 or uint8 block codes with their ``*_scales`` lists
    ([note: state codecs]), stored rounded stochastically with bits from a hash of
    (``rounding_seed``, step, ``rounding_ids[i]`` (default: i), element); ``stochastic_params``
    rounds half params without masters stochastically too.
    """
    lr_value, lr_tensor = _split_lr(lr)
    torch.ops.fusedamp.adamw_(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, lr_value,
        lr_tensor, beta1, beta2, eps, weight_decay, amsgrad, maximize, inv_grad_scale, found_inf,
        clip_coef, write_unscaled_grads, exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sq_scales,
        rounding_ids, rounding_seed, stochastic_params,
    )


def sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    inv_grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    clip_coef: Tensor | None = None,
    write_unscaled_grads: bool = True,
    momentum_buffer_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
    stochastic_params: bool = False,
) -> None:
    """One fused SGD step over same-dtype, same-device lists (see csrc/registration.cpp); the
    momentum buffers and ``rounding_ids`` as in :func:`adamw_`."""
    lr_value, lr_tensor = _split_lr(lr)
    torch.ops.fusedamp.sgd_(
        params, grads, momentum_buffers, masters, steps, lr_value, lr_tensor, momentum,
        dampening, weight_decay, nesterov, maximize, inv_grad_scale, found_inf, clip_coef,
        write_unscaled_grads, momentum_buffer_scales, rounding_ids, rounding_seed, stochastic_params,
    )


def muon_momentum_(
    updates: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    steps: list[Tensor],
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    inv_grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    clip_coef: Tensor | None = None,
    write_unscaled_grads: bool = True,
    momentum_buffer_scales: list[Tensor] | None = None,
    rounding_ids: list[int] | None = None,
    rounding_seed: int = 0,
) -> None:
    """The elementwise first half of a Muon step (see csrc/registration.cpp): each buffer lerped
    toward its (unscaled, clipped) grad, and the update to orthogonalize written into
    ``updates`` (float32 or bfloat16). ``steps`` are read, not incremented.

    >>> muon_momentum_([update], [grad], [buffer], [torch.zeros(())], momentum=0.95)
    """
    torch.ops.fusedamp.muon_momentum_(
        updates, grads, momentum_buffers, steps, momentum, nesterov, inv_grad_scale, found_inf,
        clip_coef, write_unscaled_grads, momentum_buffer_scales, rounding_ids, rounding_seed,
    )


def encode_state(values: Tensor, is_signed: bool) -> tuple[Tensor, Tensor]:
    """The 8-bit block codes of a float32 state (csrc/include/fusedamp/math/codec.h), rounded to
    nearest: uint8 codes in ``values``' memory format and one bfloat16 scale per 256 elements of
    storage order (the sign bit of a signed state's scale says which form its block's codes
    take). CPU.

    >>> codes, scales = encode_state(torch.tensor([0.5, -0.25]), True)
    >>> decode_state(codes, scales, True)
    tensor([ 0.5000, -0.2500])
    """
    return torch.ops.fusedamp.encode_state(values, is_signed)


def decode_state(codes: Tensor, scales: Tensor, is_signed: bool) -> Tensor:
    """The float32 values of block codes made by :func:`encode_state` (or an optimizer step). CPU."""
    return torch.ops.fusedamp.decode_state(codes, scales, is_signed)


def _split_lr(lr: float | Tensor) -> tuple[float, Tensor | None]:
    if isinstance(lr, Tensor):
        return 0.0, lr
    return float(lr), None


def _in_place_fake(name: str) -> Callable[..., None]:
    """The fake kernel of an in-place op: nothing to compute, but the dispatcher also picks it
    for real tensors when one of them is on the meta device, which would silently do nothing:
    a call that mixes meta and other tensors is refused (fake tensors carry their real device)."""

    def fake(*args: Any, **kwargs: Any) -> None:
        tensors = [
            tensor
            for arg in (*args, *kwargs.values())
            for tensor in (arg if isinstance(arg, (list, tuple)) else (arg,))
            if isinstance(tensor, Tensor)
        ]
        devices = {str(tensor.device) for tensor in tensors}
        if "meta" in devices and len(devices) > 1:
            others = ", ".join(sorted(devices - {"meta"}))
            raise RuntimeError(
                f"fusedamp: {name}: some tensors are on the meta device and others on {others}; "
                "every tensor of one call must be on one device (move them with .to(device))"
            )

    return fake


# In-place ops return nothing: their fake kernels only check the devices.
for _name in ("unscale_", "check_and_norm_", "update_scale_", "adamw_", "sgd_", "muon_momentum_"):
    torch.library.register_fake(f"fusedamp::{_name}")(_in_place_fake(_name))


@torch.library.register_fake("fusedamp::encode_state")
def _encode_state_fake(values: Tensor, is_signed: bool) -> tuple[Tensor, Tensor]:
    blocks = (values.numel() + 255) // 256
    return torch.empty_like(values, dtype=torch.uint8), values.new_empty((blocks,), dtype=torch.bfloat16)


@torch.library.register_fake("fusedamp::decode_state")
def _decode_state_fake(codes: Tensor, scales: Tensor, is_signed: bool) -> Tensor:
    return torch.empty_like(codes, dtype=torch.float32)


@torch.library.register_fake("fusedamp::split_bf16_remainder")
def _split_bf16_remainder_fake(master: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(master, dtype=torch.bfloat16), torch.empty_like(master, dtype=torch.int16)


@torch.library.register_fake("fusedamp::join_bf16_remainder")
def _join_bf16_remainder_fake(param: Tensor, remainder: Tensor) -> Tensor:
    return torch.empty_like(param, dtype=torch.float32)


# --- GEMM ------------------------------------------------------------------------------------

GEMM_ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh")


def gemm(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``act(a @ b + bias)`` with fp32 accumulation, rounded once to ``out_dtype``.

    ``a`` is ``(..., K)`` float16 or bfloat16 (leading dims flattened), ``b`` is ``(K, N)`` of the
    same dtype with any strides (``W.t()`` gives ``x @ W.T`` without a copy), ``bias`` is ``(N,)``
    in ``a``'s dtype or float32, ``out_dtype`` is ``a``'s dtype (default) or float32.
    ``activation`` is one of :data:`GEMM_ACTIVATIONS` (``gelu`` is the exact erf form). On CPU, and
    on CUDA with the ``reference`` backend (see :func:`set_gemm_backend`), the operands are upcast
    to float32 and multiplied by ATen; the CUDA kernels accumulate in float32 on Tensor Cores.
    """
    return torch.ops.fusedamp.gemm(a, b, bias, activation, out_dtype, False)[0]


def gemm_with_preactivation(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Like :func:`gemm`, also returning ``a @ b + bias`` (in ``out_dtype``) from the same pass:
    what the activation's backward needs, so it is not recomputed."""
    out, preact = torch.ops.fusedamp.gemm(a, b, bias, activation, out_dtype, True)
    return out, preact


def gemm_backend() -> str:
    """The code CUDA gemms run on: ``reference``, ``auto``, ``mma_sync``, ``wgmma``,
    ``wgmma_cooperative`` or ``wgmma_pingpong``."""
    return _C.gemm_backend()


def set_gemm_backend(name: str) -> str:
    """Choose the CUDA gemm code, process-wide; returns the previous choice.

    ``reference`` (default: on an H200 both kernel families ran slower than cuBLAS) upcasts and
    uses ATen; ``auto`` runs wgmma on sm_90 and mma.sync on other sm_80+ GPUs; ``mma_sync`` and
    ``wgmma`` force a kernel family (wgmma choosing its schedule per shape), ``wgmma_cooperative``
    and ``wgmma_pingpong`` force wgmma with one schedule. Operands a kernel cannot take (a leading
    dimension that is not a multiple of 8, a misaligned pointer, K == 0; for wgmma also N not a
    multiple of 8 or a float32 output) fall back to ``reference`` (``auto``: wgmma falls back to
    mma.sync first).
    """
    return _C.set_gemm_backend(name)


@torch.library.register_fake("fusedamp::gemm")
def _gemm_fake(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype | None = None,
    keep_preactivation: bool = False,
) -> tuple[Tensor, Tensor]:
    torch._check(b.dim() == 2, lambda: "fusedamp.gemm: b must be 2-D (K, N)")
    torch._check(a.shape[-1] == b.shape[0], lambda: "fusedamp.gemm: a's last dim must equal K")
    shape = (*a.shape[:-1], b.shape[1])
    dtype = out_dtype or a.dtype
    out = a.new_empty(shape, dtype=dtype)
    preact = a.new_empty(shape if keep_preactivation else (0,), dtype=dtype)
    return out, preact


def _gemm_setup_context(
    ctx: torch.autograd.function.FunctionCtx,
    inputs: tuple[object, ...],
    output: tuple[Tensor, Tensor],
) -> None:
    # Trailing arguments left at their schema defaults may be absent.
    defaults = (None, "none", None, False)
    a, b, bias, activation, out_dtype, keep_preactivation = (*inputs, *defaults[len(inputs) - 2 :])
    ctx.activation = activation
    ctx.out_dtype = out_dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    preact = output[1] if keep_preactivation else None
    ctx.save_for_backward(a, b, bias, preact)


def _activation_backward(grad: Tensor, z: Tensor, activation: str) -> Tensor:
    if activation == "relu":
        return torch.where(z > 0, grad, torch.zeros_like(grad))
    if activation in ("gelu", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward(grad.float(), z.float(), approximate=approximate)
    return grad


def _gemm_backward(
    ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor | None, grad_preact: Tensor | None
) -> tuple[Tensor | None, ...]:
    a, b, bias, preact = ctx.saved_tensors
    k, n = b.shape
    grad_z = torch.zeros((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
    if grad_out is not None:
        if ctx.activation == "none":
            grad_z = grad_out
        else:
            z = preact
            if z is None:
                z = torch.ops.fusedamp.gemm(a, b, bias, "none", ctx.out_dtype, False)[0]
            grad_z = _activation_backward(grad_out, z, ctx.activation)
    if grad_preact is not None and grad_preact.numel() > 0:
        grad_z = grad_z + grad_preact
    m = a.shape[:-1].numel()
    grad_z2d = grad_z.reshape(m, n).to(a.dtype)
    a2d = a.reshape(m, k)
    grad_a = grad_b = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_a = gemm(grad_z2d, b.t()).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        grad_b = gemm(a2d.t(), grad_z2d)
    if bias is not None and ctx.needs_input_grad[2]:
        grad_bias = grad_z.reshape(m, n).float().sum(0).to(ctx.bias_dtype)
    return grad_a, grad_b, grad_bias, None, None, None


torch.library.register_autograd(
    "fusedamp::gemm", _gemm_backward, setup_context=_gemm_setup_context
)


# --- A build without the CUDA kernels ----------------------------------------------------------


def _cuda_kernels_missing_error(op: str) -> RuntimeError:
    """What a CUDA tensor meets at a fusedamp op in a build without the CUDA kernels: the cause
    (the build's own words, from fusedamp/_build_meta.py) and the fix."""
    from fusedamp import _build_meta

    # A build made before setup.py recorded its reason has none to give.
    reason = getattr(_build_meta, "CUDA_REASON", "not recorded by this build")
    cuda = torch.version.cuda
    toolkit = f"the CUDA {cuda.split('.')[0]} toolkit" if cuda else "a CUDA build of torch and its toolkit"
    return RuntimeError(
        f"fusedamp: {op} got CUDA tensors, but this fusedamp was built without its CUDA kernels "
        f"(the build said: CUDA kernels {reason}). Rebuild it with them: with {toolkit} installed "
        "(its nvcc on PATH, or CUDA_HOME set), run `FUSEDAMP_CUDA=1 pip install --no-build-isolation .` "
        "in fusedamp's checkout; see Troubleshooting in docs/install.md"
    )


def _refuse_cuda_tensors(op: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise _cuda_kernels_missing_error(op)

    return kernel


def _register_cuda_refusals() -> torch.library.Library | None:
    """In a build without the CUDA kernels, gives each fusedamp op that has no CUDA kernel one
    that raises :func:`_cuda_kernels_missing_error`: the dispatcher's own error ("Could not run
    'fusedamp::adamw_' with arguments from the 'CUDA' backend") names neither cause nor fix. The
    library must stay referenced: dropping it removes the kernels."""
    if _C.cuda_compiled:
        return None
    library = torch.library.Library("fusedamp", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("fusedamp::"):
            continue
        if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in ("CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")):
            continue
        op = name.removeprefix("fusedamp::")
        library.impl(op, _refuse_cuda_tensors(op), "CUDA")
    return library


_CUDA_REFUSALS = _register_cuda_refusals()

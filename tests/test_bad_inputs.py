"""Bad input to every public entry point gets a clear error (type and message) and leaves every
tensor as it was; property tests of the ops against float64 references; 10,000 tensors in one call.

Complements tests/test_optim.py, tests/test_amp_ops.py and tests/test_grad_scaler.py (which test
the constructors' torch-compatible validation, the scaler's misuse errors and the ops' results
on hand-picked inputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fusedamp
from fusedamp import ops

OPTIMIZERS = (fusedamp.FusedAdamW, fusedamp.FusedSGD)
HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in tensors]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """Bitwise (NaN payloads included)."""
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(as_bytes(old), as_bytes(new))


# --- optimizer constructors -----------------------------------------------------------------


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.complex32])
def test_unsupported_param_dtypes(cls: type, dtype: torch.dtype) -> None:
    param = torch.zeros(3, dtype=dtype)
    message = (
        r"supports float32, float16, bfloat16, float64, complex64 and complex128 params; "
        rf"param 0 of group 0 is {dtype}"
    )
    with pytest.raises(TypeError, match=message):
        cls([param], lr=0.1)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": float("nan")}, "Invalid learning rate: nan"),
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"lr": torch.tensor(-1.0)}, "Invalid learning rate"),
        ({"lr": float("inf")}, "lr=inf in param group 0; it must be finite"),
        ({"weight_decay": float("nan")}, "Invalid weight_decay value: nan"),
        ({"max_grad_norm": float("nan")}, "Invalid max_grad_norm value: nan"),
        ({"max_grad_norm": -1.0}, "Invalid max_grad_norm value: -1.0"),
        ({"master_weights": "fp64"}, "Invalid master_weights value: 'fp64'"),
    ],
)
def test_bad_hyperparameters(cls: type, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls([nn.Parameter(torch.zeros(3))], **{"lr": 0.1, **options})


@pytest.mark.parametrize(
    ("cls", "options", "message"),
    [
        (fusedamp.FusedAdamW, {"eps": float("nan")}, "Invalid epsilon value: nan"),
        (fusedamp.FusedAdamW, {"betas": (0.9, float("nan"))}, "Invalid beta parameter at index 1: nan"),
        (fusedamp.FusedSGD, {"momentum": float("nan")}, "Invalid momentum value: nan"),
        (fusedamp.FusedSGD, {"dampening": float("nan")}, "dampening=nan in param group 0; it must be finite"),
    ],
)
def test_bad_class_specific_hyperparameters(cls: type, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls([nn.Parameter(torch.zeros(3))], **{"lr": 0.1, **options})


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_layout_and_master_mode_errors(cls: type) -> None:
    message = r"needs dense \(strided\) params; param 0 of group 0 has layout torch.sparse_coo"
    with pytest.raises(TypeError, match=message):
        cls([nn.Parameter(torch.zeros(3, 4).to_sparse())], lr=0.1)
    with pytest.raises(ValueError, match="master_weights='remainder' needs bfloat16 params"):
        cls([nn.Parameter(torch.zeros(3, dtype=torch.float16))], lr=0.1, master_weights="remainder")


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_params_that_do_not_require_grad_are_left_alone(cls: type) -> None:
    """A param without requires_grad never gets a grad: it is accepted and never updated."""
    frozen = torch.randn(4)
    trained = nn.Parameter(torch.randn(4))
    opt = cls([frozen, trained], lr=0.1)
    before = snapshot([frozen, trained])
    trained.grad = torch.ones(4)
    opt.step()
    assert torch.equal(frozen, before[0])
    assert not torch.equal(trained, before[1])
    assert frozen not in opt.state


# --- step: an error leaves everything as it was --------------------------------------------


def two_group_optimizer(cls: type) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """Two groups (fp32; bf16 with remainders), one clean step taken: state exists."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(6).to(torch.bfloat16))]
    opt = cls(
        [{"params": [params[0]]}, {"params": [params[1]], "master_weights": "remainder"}],
        lr=0.1,
        **({"momentum": 0.9} if cls is fusedamp.FusedSGD else {}),
    )
    for param in params:
        param.grad = torch.randn_like(param)
    opt.step()
    return opt, params


def optimizer_tensors(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [*params, *(value for param in params for value in opt.state[param].values())]


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_bad_lr_in_a_later_group_updates_nothing(cls: type, value: float) -> None:
    """Set after construction (a scheduler, by hand): the op would refuse it for group 1 after
    group 0 was updated; step() checks all groups first and changes nothing."""
    opt, params = two_group_optimizer(cls)
    opt.param_groups[1]["lr"] = value
    before = snapshot(optimizer_tensors(opt, params))
    with pytest.raises(ValueError, match=rf"lr={value} in param group 1; it must be finite"):
        opt.step()
    assert_unchanged(before, optimizer_tensors(opt, params))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_sparse_grad_updates_nothing(cls: type) -> None:
    opt, params = two_group_optimizer(cls)
    params[0].grad = torch.randn(5).to_sparse()
    before = snapshot(optimizer_tensors(opt, params))
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        opt.step()
    assert_unchanged(before, optimizer_tensors(opt, params))


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_transposed_and_overlapping_grads_step_like_torch(cls: type) -> None:
    """A transposed grad and an expanded one (its elements overlap in memory) are what torch's
    optimizers accept: the step reads them through a copy in the param's order."""
    reference_cls = getattr(torch.optim, cls.__name__.removeprefix("Fused"))
    for odd_grad in (torch.randn(4, 3).t(), torch.randn(1, 4).expand(3, 4)):
        weight = nn.Parameter(torch.randn(3, 4))
        reference = nn.Parameter(weight.detach().clone())
        weight.grad, reference.grad = odd_grad, odd_grad.contiguous()
        cls([weight], lr=0.1).step()
        reference_cls([reference], lr=0.1).step()
        torch.testing.assert_close(weight, reference)


# --- ops ------------------------------------------------------------------------------------


def adamw_args(count: int = 2) -> dict[str, Any]:
    torch.manual_seed(1)
    return {
        "params": [torch.randn(4) for _ in range(count)],
        "grads": [torch.randn(4) for _ in range(count)],
        "exp_avgs": [torch.rand(4) for _ in range(count)],
        "exp_avg_sqs": [torch.rand(4) for _ in range(count)],
        "max_exp_avg_sqs": [],
        "masters": [],
        "steps": [torch.ones(()) for _ in range(count)],
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.1,
    }


def tensors_of(args: dict[str, Any]) -> list[torch.Tensor]:
    return [tensor for value in args.values() if isinstance(value, list) for tensor in value]


def with_last(args: dict[str, Any], key: str, tensor: torch.Tensor) -> dict[str, Any]:
    """``args`` with the last tensor of list ``key`` replaced: earlier ones would be written
    first by a kernel that started before checking."""
    return {**args, key: [*args[key][:-1], tensor]}


SHARED_GRAD = torch.ones(3)

ADAMW_CASES: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], type, str]] = [
    (
        "short list",
        lambda a: {**a, "grads": a["grads"][:1]},
        RuntimeError,
        r"adamw_: grads has 1 tensors but params has 2; pass one per param",
    ),
    (
        "masters length",
        lambda a: {**a, "masters": [torch.zeros(4)]},
        RuntimeError,
        r"masters has 1 tensors but params has 2; pass none \(no master weights\) or one per param",
    ),
    (
        "complex param",
        lambda a: with_last(a, "params", torch.zeros(4, dtype=torch.complex64)),
        TypeError,
        r"params\[1\] is ComplexFloat but params\[0\] is Float; one call takes one param dtype",
    ),
    (
        "int grad",
        lambda a: with_last(a, "grads", torch.zeros(4, dtype=torch.int32)),
        TypeError,
        r"grads\[1\] is Int, expected Float",
    ),
    (
        "size",
        lambda a: with_last(a, "grads", torch.zeros(5)),
        RuntimeError,
        r"grads\[1\] has 5 elements but adamw_: params\[1\] has 4",
    ),
    (
        "other element order",
        lambda a: with_last(a, "exp_avgs", torch.zeros(2, 2).t()),
        RuntimeError,
        r"exp_avgs\[1\] \(sizes \[2, 2\], strides \[1, 2\]\) does not store its elements in the order of "
        r"adamw_: params\[1\]",
    ),
    (
        "overlapping",
        lambda a: with_last(a, "exp_avg_sqs", torch.zeros(1).expand(4)),
        RuntimeError,
        r"exp_avg_sqs\[1\] has gaps or overlaps in memory",
    ),
    (
        "float64 step",
        lambda a: with_last(a, "steps", torch.zeros((), dtype=torch.float64)),
        TypeError,
        r"steps\[1\] must be a float32 tensor, got Double",
    ),
    ("nan lr", lambda a: {**a, "lr": float("nan")}, ValueError, "lr is nan; it must be a finite number"),
    ("nan eps", lambda a: {**a, "eps": float("nan")}, ValueError, "eps is nan; it must be a finite number"),
    (
        "found_inf dtype",
        lambda a: {**a, "found_inf": torch.zeros((), dtype=torch.float64)},
        TypeError,
        "found_inf must be a float32 tensor, got Double",
    ),
    (
        "grad is its param",
        lambda a: with_last(a, "grads", a["params"][-1]),
        RuntimeError,
        r"adamw_: params\[1\] and grads\[1\] share memory|adamw_: grads\[1\] and params\[1\] share memory",
    ),
    (
        "one moment twice",
        lambda a: with_last(a, "exp_avg_sqs", a["exp_avgs"][-1]),
        RuntimeError,
        r"exp_av\w*\[1\] and exp_av\w*\[1\] share memory",
    ),
    (
        "overlapping params",
        lambda a: {**a, "params": list(torch.randn(6).as_strided((2, 4), (2, 1)))},
        RuntimeError,
        r"params\[0\] and params\[1\] share memory",
    ),
]


@pytest.mark.parametrize(
    ("case", "corrupt", "error", "message"), ADAMW_CASES, ids=[case[0] for case in ADAMW_CASES]
)
def test_adamw_op_refuses_and_writes_nothing(
    case: str, corrupt: Callable[[dict[str, Any]], dict[str, Any]], error: type, message: str
) -> None:
    args = corrupt(adamw_args())
    before = snapshot(tensors_of(args))
    with pytest.raises(error, match=message):
        ops.adamw_(**args)
    assert_unchanged(before, tensors_of(args))


@pytest.mark.parametrize(
    ("grads", "found_inf", "inv_scale", "error", "message"),
    [
        (
            [torch.ones(3), torch.ones(3, dtype=torch.int64)],
            torch.zeros(()),
            torch.full((), 0.5),
            TypeError,
            r"unscale_: grads\[1\] has dtype torch.int64; expected a floating point or complex",
        ),
        (
            [torch.ones(3)],
            torch.zeros((), dtype=torch.float16),
            torch.full((), 0.5),
            TypeError,
            "found_inf must be a float32 tensor, got Half",
        ),
        (
            [torch.ones(3)],
            torch.zeros(()),
            torch.full((2,), 0.5),
            RuntimeError,
            r"inv_scale must hold exactly one element, got shape \[2\]",
        ),
        (
            [SHARED_GRAD, torch.ones(2), SHARED_GRAD],
            torch.zeros(()),
            torch.full((), 0.5),
            RuntimeError,
            r"unscale_: grads\[0\] and grads\[2\] share memory",
        ),
    ],
)
def test_unscale_op_refuses_and_writes_nothing(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, error: type, message: str
) -> None:
    before = snapshot([*grads, found_inf])
    with pytest.raises(error, match=message):
        ops.unscale_(grads, found_inf, inv_scale)
    assert_unchanged(before, [*grads, found_inf])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_different_devices_in_one_call() -> None:
    grads = [torch.ones(3, device="cuda"), torch.ones(3)]
    found_inf = torch.zeros((), device="cuda")
    before = snapshot(grads)
    with pytest.raises(RuntimeError, match=r"grads\[1\]"):
        ops.unscale_(grads, found_inf, torch.full((), 0.5, device="cuda"))
    assert_unchanged(before, grads)


def test_scaler_refuses_non_tensor_outputs() -> None:
    scaler = fusedamp.GradScaler("cpu")
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([torch.ones(()), 1.0])


# --- property tests against float64 references ---------------------------------------------

FLOAT_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
SHAPES = st.lists(st.integers(0, 40), min_size=1, max_size=6)


def random_values(seed: int, count: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64) * scale


@settings(max_examples=30, deadline=None)
@given(
    sizes=SHAPES,
    dtype=FLOAT_DTYPES,
    seed=st.integers(0, 2**31 - 1),
    scale_exponent=st.integers(-12, 12),
    poison=st.sampled_from([None, "inf", "-inf", "nan"]),
)
def test_unscale_matches_float64(
    sizes: list[int], dtype: torch.dtype, seed: int, scale_exponent: int, poison: str | None
) -> None:
    """unscale_ multiplies by inv_scale in fp32 and rounds once to the grad dtype: within half an
    ulp of the float64 product plus the fp32 rounding; found_inf is 1 iff any value is inf/NaN."""
    values = [
        random_values(seed + index, size, 2.0**scale_exponent).to(dtype) for index, size in enumerate(sizes)
    ]
    if poison is not None and values[-1].numel():
        values[-1][-1] = float(poison)
    grads = [value.clone() for value in values]
    inv_scale = torch.tensor(2.0**-scale_exponent * 1.25, dtype=torch.float32)
    found_inf = torch.zeros(())
    ops.unscale_(grads, found_inf, inv_scale)
    for value, grad in zip(values, grads, strict=True):
        expected = value.double() * inv_scale.double()
        torch.testing.assert_close(
            grad.double(),
            expected,
            rtol=HALF_ULP[dtype] + 2.0**-24,
            atol=0.0,
            equal_nan=True,
        )
    poisoned = any(not torch.isfinite(value).all() for value in values)
    assert found_inf.item() == (1.0 if poisoned else 0.0)


def adamw_float64(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW's formula in float64."""
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = exp_avg_sq.sqrt() / math.sqrt(bias_correction2) + eps
    return param - lr / bias_correction1 * exp_avg / denom, exp_avg, exp_avg_sq


@settings(max_examples=30, deadline=None)
@given(
    sizes=SHAPES,
    param_dtype=FLOAT_DTYPES,
    seed=st.integers(0, 2**31 - 1),
    step=st.integers(0, 50),
    lr=st.floats(1e-5, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    weight_decay=st.floats(0.0, 0.5),
)
def test_adamw_matches_float64(
    sizes: list[int],
    param_dtype: torch.dtype,
    seed: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One adamw_ step (fp32 masters for half params) against float64 AdamW: moments and the
    master within fp32 rounding; a half param is its master rounded to nearest, exactly."""
    eps = 1e-8
    masters = [random_values(seed + 3 * i, size, 1.0).float() for i, size in enumerate(sizes)]
    grads64 = [random_values(seed + 3 * i + 1, size, 1.0) for i, size in enumerate(sizes)]
    exp_avgs = [random_values(seed + 3 * i + 2, size, 0.1).float() for i, size in enumerate(sizes)]
    exp_avg_sqs = [exp_avg.square() * 1.5 for exp_avg in exp_avgs]
    half = param_dtype != torch.float32
    params = [master.to(param_dtype) for master in masters]
    grads = [grad.to(param_dtype) for grad in grads64]
    expected = [
        adamw_float64(
            master.double(),
            grad.double(),
            exp_avg.double(),
            exp_avg_sq.double(),
            step + 1,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        )
        for master, grad, exp_avg, exp_avg_sq in zip(
            masters if half else params, grads, exp_avgs, exp_avg_sqs, strict=True
        )
    ]
    work_masters = [master.clone() for master in masters] if half else []
    steps = [torch.full((), float(step)) for _ in sizes]
    ops.adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        work_masters,
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
    )
    for index, (want_param, want_avg, want_avg_sq) in enumerate(expected):
        assert steps[index].item() == step + 1
        torch.testing.assert_close(exp_avgs[index].double(), want_avg, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(exp_avg_sqs[index].double(), want_avg_sq, rtol=1e-5, atol=1e-9)
        updated = work_masters[index] if half else params[index]
        torch.testing.assert_close(updated.double(), want_param, rtol=1e-5, atol=1e-5 * lr)
        if half:
            assert torch.equal(params[index], work_masters[index].to(param_dtype))


# --- scale ----------------------------------------------------------------------------------

MANY = 10_000


def many_tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    """MANY tensors of 0 to 7 elements (zero-element ones at many slot positions)."""
    generator = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 8, (MANY,), generator=generator).tolist()
    return [torch.randn(size, generator=generator).to(dtype) for size in sizes]


def test_unscale_10000_tensors_in_one_call() -> None:
    grads = many_tensors(torch.bfloat16)
    grads[MANY // 2 + 1] = torch.full((3,), float("inf"), dtype=torch.bfloat16)
    expected = [(grad.float() * 0.25).to(torch.bfloat16) for grad in grads]
    found_inf = torch.zeros(())
    ops.unscale_(grads, found_inf, torch.full((), 0.25))
    assert found_inf.item() == 1.0
    for grad, want in zip(grads, expected, strict=True):
        assert torch.equal(grad, want)


def test_adamw_10000_tensors_in_one_call() -> None:
    """Against torch.optim.AdamW (foreach=False) on the same 10,000 fp32 tensors."""
    params = many_tensors(torch.float32)
    grads = [torch.randn_like(param) for param in params]
    reference = [nn.Parameter(param.clone()) for param in params]
    for ref, grad in zip(reference, grads, strict=True):
        ref.grad = grad.clone()
    torch.optim.AdamW(reference, lr=1e-2, foreach=False).step()
    ops.adamw_(
        params,
        grads,
        [torch.zeros_like(p) for p in params],
        [torch.zeros_like(p) for p in params],
        [],
        [],
        [torch.zeros(()) for _ in params],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=1e-2,
    )
    for param, ref in zip(params, reference, strict=True):
        torch.testing.assert_close(param, ref.detach(), rtol=1e-6, atol=1e-7)

"""Bad input to the optimizers and the scaler gets a clear error (type and message) and leaves
every tensor as it was; 10,000 tensors in one op call. The ops' own bad inputs are rows of
tests/op_table.py.

Complements tests/test_optim.py and tests/test_grad_scaler.py (which test the constructors'
torch-compatible validation and the scaler's misuse errors).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from op_table import assert_unchanged, snapshot
from torch import nn

import fusedamp
from fusedamp import ops

OPTIMIZERS = (fusedamp.FusedAdamW, fusedamp.FusedSGD)


# --- optimizer constructors -----------------------------------------------------------------


# torch warns when it makes a complex32 tensor at all; the test needs one to pass in.
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
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
    before = [frozen.clone(), trained.detach().clone()]
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


@pytest.mark.parametrize("cls", [fusedamp.FusedAdamW])  # FusedSGD takes sparse grads, as torch's SGD
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


# --- the scaler -------------------------------------------------------------------------------


def test_scaler_refuses_non_tensor_outputs() -> None:
    scaler = fusedamp.GradScaler("cpu")
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([torch.ones(()), 1.0])


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

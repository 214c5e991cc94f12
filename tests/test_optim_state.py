"""state_dict round trips (bitwise resume), loading torch.optim state, the dtypes and devices
that loading produces, and switching master_weights on a live optimizer."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import Tensor

from fusedamp.optim import FusedAdamW, FusedSGD

CASES = [
    pytest.param(FusedAdamW, torch.float32, {"lr": 1.0, "betas": (0.1, 0.25)}, id="adamw-fp32"),
    pytest.param(FusedAdamW, torch.float16, {"lr": 0.1, "amsgrad": True}, id="adamw-fp16-amsgrad"),
    pytest.param(FusedAdamW, torch.bfloat16, {"master_weights": "remainder"}, id="adamw-bf16-remainder"),
    pytest.param(FusedAdamW, torch.bfloat16, {"master_weights": False}, id="adamw-bf16-no-master"),
    pytest.param(FusedSGD, torch.bfloat16, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, id="sgd-bf16"),
    pytest.param(FusedSGD, torch.float16, {"lr": 0.1, "momentum": 0.5, "dampening": 0.5}, id="sgd-fp16"),
]
SIZES = (7, 0, 22, 65537)


def make_model(dtype: torch.dtype) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator).to(dtype).requires_grad_() for n in SIZES]


def step_on_seeded_grads(
    opt: torch.optim.Optimizer, params: list[Tensor], steps: range, grad_dtype: torch.dtype | None = None
) -> None:
    """Steps with grads that depend only on the step index, so runs can be split and resumed.

    The grads are rounded to ``grad_dtype`` (default: each param's dtype) before use.
    """
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            grad = torch.randn(param.shape, generator=generator).to(grad_dtype or param.dtype)
            param.grad = grad.to(param.dtype)
        opt.step()


def bits(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def saved(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize(("cls", "dtype", "options"), CASES)
def test_resuming_from_a_state_dict_is_bitwise_identical_to_not_stopping(cls, dtype, options) -> None:
    straight_params = make_model(dtype)
    straight = cls(straight_params, **options)
    step_on_seeded_grads(straight, straight_params, range(20))

    first_params = make_model(dtype)
    first = cls(first_params, **options)
    step_on_seeded_grads(first, first_params, range(10))
    checkpoint = saved({"params": [p.detach() for p in first_params], "optim": first.state_dict()})

    resumed_params = [p.clone().requires_grad_() for p in checkpoint["params"]]
    resumed = cls(resumed_params)  # the hyperparameters come from the state_dict
    resumed.load_state_dict(checkpoint["optim"])
    step_on_seeded_grads(resumed, resumed_params, range(10, 20))

    for straight_param, resumed_param in zip(straight_params, resumed_params, strict=True):
        assert torch.equal(bits(straight_param), bits(resumed_param))
        straight_state, resumed_state = straight.state[straight_param], resumed.state[resumed_param]
        assert straight_state.keys() == resumed_state.keys()
        for key, value in straight_state.items():
            assert value.dtype == resumed_state[key].dtype
            assert torch.equal(bits(value), bits(resumed_state[key])), key


def test_loaded_state_is_copied_not_shared() -> None:
    params = make_model(torch.bfloat16)
    opt = FusedAdamW(params)
    step_on_seeded_grads(opt, params, range(2))
    other_params = [p.detach().clone().requires_grad_() for p in params]
    other = FusedAdamW(other_params)
    other.load_state_dict(opt.state_dict())
    step_on_seeded_grads(other, other_params, range(2, 3))
    assert opt.state[params[0]]["step"].item() == 2.0 and other.state[other_params[0]]["step"].item() == 3.0
    assert not torch.equal(opt.state[params[3]]["master"], other.state[other_params[3]]["master"])


def test_load_casts_state_to_each_params_device_and_dtype() -> None:
    params = make_model(torch.bfloat16)
    opt = FusedAdamW(params, amsgrad=True)
    step_on_seeded_grads(opt, params, range(3))
    state_dict = opt.state_dict()
    # A checkpoint written by other code: float64 tensors, steps as Python numbers.
    for state in state_dict["state"].values():
        for key in list(state):
            state[key] = state[key].item() if key == "step" else state[key].double()
    loaded = FusedAdamW(make_model(torch.bfloat16), amsgrad=True)
    loaded.load_state_dict(state_dict)
    for param in loaded.param_groups[0]["params"]:
        state = loaded.state[param]
        assert state["step"].shape == () and state["step"].dtype == torch.float32
        assert state["step"].item() == 3.0 and state["step"].device == param.device
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"):
            assert state[key].dtype == torch.float32 and state[key].is_contiguous()
            assert state[key].shape == param.shape
    remainder_params = make_model(torch.bfloat16)
    remainder = FusedAdamW(remainder_params, master_weights="remainder")
    step_on_seeded_grads(remainder, remainder_params, range(1))
    reloaded = FusedAdamW(make_model(torch.bfloat16), master_weights="remainder")
    reloaded.load_state_dict(saved(remainder.state_dict()))
    assert all(s["master_remainder"].dtype == torch.int16 for s in reloaded.state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("cls", "torch_cls", "options"),
    [
        (FusedAdamW, torch.optim.AdamW, {"lr": 0.1, "amsgrad": True}),
        (FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_a_torch_optim_state_dict_loads(cls, torch_cls, options, dtype) -> None:
    # torch trains 5 steps on params of `dtype`. Its state_dict then loads into the fused
    # optimizer (masters made from the params) and into an fp32 torch reference, and both
    # train 5 more steps on the same grads.
    torch_params = make_model(dtype)
    torch_opt = torch_cls(torch_params, **options)
    step_on_seeded_grads(torch_opt, torch_params, range(5))
    ref_params = [p.detach().float().requires_grad_() for p in torch_params]
    ref = torch_cls(ref_params, **options)
    ref.load_state_dict(torch_opt.state_dict())
    fused_params = [p.detach().clone().requires_grad_() for p in torch_params]
    fused = cls(fused_params, lr=123.0)
    fused.load_state_dict(torch_opt.state_dict())
    assert fused.param_groups[0]["lr"] == 0.1 and fused.param_groups[0]["master_weights"] is True
    for param in fused_params:
        assert all(v.dtype == torch.float32 and v.device == param.device for v in fused.state[param].values())
    step_on_seeded_grads(fused, fused_params, range(5, 10))
    step_on_seeded_grads(ref, ref_params, range(5, 10), grad_dtype=dtype)
    for fused_param, ref_param in zip(fused_params, ref_params, strict=True):
        torch.testing.assert_close(fused.master_of(fused_param), ref_param.detach(), rtol=1e-5, atol=1e-5)


def test_switching_master_weights_keeps_the_fp32_master() -> None:
    kept_params, switched_params = make_model(torch.bfloat16), make_model(torch.bfloat16)
    kept, switched = FusedAdamW(kept_params, lr=0.1), FusedAdamW(switched_params, lr=0.1)
    step_on_seeded_grads(kept, kept_params, range(3))
    step_on_seeded_grads(switched, switched_params, range(3))
    switched.param_groups[0]["master_weights"] = "remainder"
    step_on_seeded_grads(kept, kept_params, range(3, 6))
    step_on_seeded_grads(switched, switched_params, range(3, 6))
    for kept_param, param in zip(kept_params, switched_params, strict=True):
        assert "master" not in switched.state[param]
        assert torch.equal(bits(kept.master_of(kept_param)), bits(switched.master_of(param)))
    switched.param_groups[0]["master_weights"] = True
    step_on_seeded_grads(kept, kept_params, range(6, 8))
    step_on_seeded_grads(switched, switched_params, range(6, 8))
    for kept_param, param in zip(kept_params, switched_params, strict=True):
        assert "master_remainder" not in switched.state[param]
        assert torch.equal(kept_param.detach(), param.detach())
        assert torch.equal(kept.master_of(kept_param), switched.master_of(param))


def test_deep_copies_and_pickles_keep_fusedamps_options() -> None:
    params = make_model(torch.float16)
    opt = FusedSGD(params, lr=0.1, momentum=0.9, max_grad_norm=0.5)
    step_on_seeded_grads(opt, params, range(2))
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone.max_grad_norm == 0.5 and clone.last_grad_norm is None
        clone_params = clone.param_groups[0]["params"]
        step_on_seeded_grads(clone, clone_params, range(2, 3))
        assert clone.last_grad_norm is not None
        assert clone.state[clone_params[3]]["master"].dtype == torch.float32


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"), [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)]
)
@pytest.mark.parametrize("grad_order", ["row-major", "column-major"])
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_grads_of_the_other_half_dtype_step_as_their_fp32_values(
    cls, param_dtype, grad_dtype, grad_order
) -> None:
    """A half param whose grad is the other half type (param.grad_dtype set; torch refuses it by
    default) steps through an fp32 copy of the grad: the bits of the step on those fp32 grads,
    and the unscaled grad written back as the kernels write it, also into a grad stored in
    another order than its param. The ops themselves refuse the pair."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(20, 15, generator=generator)
    crossed, reference = values.to(param_dtype), values.to(param_dtype)
    crossed.grad_dtype, reference.grad_dtype = grad_dtype, torch.float32
    options = {"lr": 1e-2, "momentum": 0.9} if cls is FusedSGD else {"lr": 1e-2}
    crossed_opt, reference_opt = cls([crossed], **options), cls([reference], **options)
    for _ in range(3):
        grad = (torch.randn(20, 15, generator=generator) * 2.0**8).to(grad_dtype)
        if grad_order == "column-major":
            grad = grad.t().contiguous().t()
        crossed.grad, reference.grad = grad.clone(), grad.float()
        for opt in (crossed_opt, reference_opt):
            opt.grad_scale, opt.found_inf = torch.tensor(2.0**8), torch.zeros(())
            opt.step()
        assert crossed.grad.dtype == grad_dtype
        assert torch.equal(crossed.grad, reference.grad.to(grad_dtype))
    assert torch.equal(crossed, reference)
    with pytest.raises(TypeError, match="grads are .* but params .*; pass grads of the params' dtype"):
        params, grads = [torch.zeros(3, dtype=param_dtype)], [torch.zeros(3, dtype=grad_dtype)]
        scalars = (1e-2, None, 0.0, 0.0, 0.0, False, False, None, None, None, True)
        torch.ops.fusedamp.sgd_(params, grads, [], [], [torch.zeros(())], *scalars)

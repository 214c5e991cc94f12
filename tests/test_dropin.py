"""Drop-in parity: what a user's torch.optim.AdamW / SGD / torch.amp.GradScaler code does works
unchanged with fusedamp's classes and gives torch's results: memory formats (channels_last,
transposed, strided slices), torch's constructor keywords, float64 and complex params, float64
grads under the scaler, named params, fusedamp.__version__."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fusedamp
from fusedamp import FusedAdamW, FusedSGD

PAIRS = [
    pytest.param(
        FusedAdamW, torch.optim.AdamW, {"lr": 0.1, "betas": (0.5, 0.75), "weight_decay": 0.1}, id="adamw"
    ),
    pytest.param(
        FusedAdamW,
        torch.optim.AdamW,
        {"lr": 0.1, "amsgrad": True, "maximize": True},
        id="adamw-amsgrad-maximize",
    ),
    pytest.param(FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, id="sgd"),
    pytest.param(
        FusedSGD,
        torch.optim.SGD,
        {"lr": 0.2, "momentum": 0.5, "nesterov": True, "maximize": True},
        id="sgd-nesterov-maximize",
    ),
    pytest.param(
        FusedSGD, torch.optim.SGD, {"lr": 0.2, "momentum": 0.5, "dampening": 0.25}, id="sgd-dampening"
    ),
]


def step_both(
    fused_cls: type, torch_cls: type, options: dict[str, Any], make_param, **fused_options: Any
) -> tuple[list[Tensor], list[Tensor], torch.optim.Optimizer]:
    """Steps fusedamp and torch three times on equal params made by ``make_param(seed)`` (three
    of them) with equal random grads; returns both sets of params and the fused optimizer."""
    fused_params = [nn.Parameter(make_param(seed)) for seed in range(3)]
    torch_params = [nn.Parameter(make_param(seed)) for seed in range(3)]
    fused = fused_cls(fused_params, **options, **fused_options)
    reference = torch_cls(torch_params, **options)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for fused_param, torch_param in zip(fused_params, torch_params, strict=True):
            grad = torch.randn(fused_param.shape, generator=generator, dtype=torch.float64)
            fused_param.grad = grad.to(fused_param.dtype)
            torch_param.grad = grad.to(fused_param.dtype)
        fused.step()
        reference.step()
    return fused_params, torch_params, fused


def small_param(seed: int) -> Tensor:
    return torch.randn(5, generator=torch.Generator().manual_seed(seed))


def conv_weight(seed: int) -> Tensor:
    weight = torch.randn(8, 3, 3, 5, generator=torch.Generator().manual_seed(seed))
    return weight.to(memory_format=torch.channels_last)


@pytest.mark.parametrize(("fused_cls", "torch_cls", "options"), PAIRS)
def test_channels_last_params_are_stepped_in_place_with_state_in_their_format(fused_cls, torch_cls, options):
    fused_params, torch_params, fused = step_both(fused_cls, torch_cls, options, conv_weight)
    for param, reference in zip(fused_params, torch_params, strict=True):
        assert param.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(param, reference, rtol=1e-5, atol=1e-6)
        for key, state in fused.state[param].items():
            if state.dim() > 0:
                assert state.stride() == param.stride(), key


@pytest.mark.parametrize(("fused_cls", "torch_cls", "options"), PAIRS)
@pytest.mark.parametrize("layout", ["transposed", "permuted", "strided-slice"])
def test_any_param_layout_steps_like_torch(fused_cls, torch_cls, options, layout):
    def make(seed: int) -> Tensor:
        base = torch.randn(6, 10, 4, generator=torch.Generator().manual_seed(seed))
        if layout == "transposed":
            return base[:, :, 0].t()
        if layout == "permuted":
            return base.permute(2, 0, 1)
        return base[:, ::3, 1:3]  # gaps in memory: stepped through a contiguous copy

    fused_params, torch_params, _ = step_both(fused_cls, torch_cls, options, make)
    for param, reference in zip(fused_params, torch_params, strict=True):
        torch.testing.assert_close(param, reference, rtol=1e-5, atol=1e-6)


def test_a_strided_slice_param_updates_the_storage_it_views() -> None:
    storage = torch.zeros(4, 6)
    param = nn.Parameter(storage[:, ::2])  # shares storage with `storage`
    param.grad = torch.ones(4, 3)
    FusedSGD([param], lr=0.5).step()
    assert torch.equal(storage[:, ::2], torch.full((4, 3), -0.5))
    assert torch.equal(storage[:, 1::2], torch.zeros(4, 3))


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_grad_in_another_layout_than_its_param_is_unscaled_and_written_back(cls) -> None:
    """A channels_last param with a contiguous grad under a scaler: the step matches the
    unscaled step, and the grad holds the unscaled values afterwards (as torch leaves it)."""
    param = nn.Parameter(conv_weight(0))
    twin = nn.Parameter(conv_weight(0))
    grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1))
    param.grad = (grad * 1024).contiguous()
    twin.grad = grad.clone().to(memory_format=torch.channels_last)
    opt, twin_opt = cls([param], lr=0.1), cls([twin], lr=0.1)
    opt.grad_scale = torch.tensor(1024.0)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    twin_opt.step()
    assert param.grad.is_contiguous()
    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(param, twin, rtol=0, atol=0)


@pytest.mark.parametrize(("fused_cls", "torch_cls", "options"), PAIRS)
@pytest.mark.parametrize(
    "flags",
    [{"fused": True}, {"foreach": False}, {"foreach": True}, {"fused": False}, {"differentiable": False}],
)
def test_torch_implementation_keywords_are_accepted(fused_cls, torch_cls, options, flags):
    fused_params, torch_params, fused = step_both(fused_cls, torch_cls, options, small_param, **flags)
    for param, reference in zip(fused_params, torch_params, strict=True):
        torch.testing.assert_close(param, reference, rtol=1e-5, atol=1e-6)
    for key, value in flags.items():
        assert fused.param_groups[0][key] == value


def test_capturable_is_accepted_by_fused_adamw() -> None:
    opt = FusedAdamW([nn.Parameter(torch.ones(3))], lr=0.1, capturable=True)
    assert opt.param_groups[0]["capturable"] is True


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_differentiable_true_is_a_clear_error(cls) -> None:
    torch_name = cls.__name__.removeprefix("Fused")
    message = rf"{cls.__name__} does not support differentiable=True.*"
    message += rf"torch.optim.{torch_name}\(differentiable=True\)"
    with pytest.raises(RuntimeError, match=message):
        cls([nn.Parameter(torch.ones(3))], lr=0.1, differentiable=True)
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cls([nn.Parameter(torch.ones(3))], lr=0.1, fused=True, foreach=True)


@pytest.mark.parametrize(("fused_cls", "torch_cls", "options"), PAIRS)
def test_float64_params_match_torch(fused_cls, torch_cls, options):
    fused_params, torch_params, fused = step_both(
        fused_cls,
        torch_cls,
        options,
        lambda seed: torch.randn(4, 33, generator=torch.Generator().manual_seed(seed), dtype=torch.float64),
    )
    for param, reference in zip(fused_params, torch_params, strict=True):
        assert param.dtype == torch.float64
        torch.testing.assert_close(param, reference, rtol=1e-13, atol=1e-15)
    for state in fused.state[fused_params[0]].values():
        if state.dim() > 0:
            assert state.dtype == torch.float64


@pytest.mark.parametrize(("fused_cls", "torch_cls", "options"), PAIRS)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_params_match_torch(fused_cls, torch_cls, options, dtype):
    fused_params, torch_params, fused = step_both(
        fused_cls,
        torch_cls,
        options,
        lambda seed: torch.randn(3, 17, generator=torch.Generator().manual_seed(seed), dtype=dtype),
    )
    tolerance = 1e-5 if dtype == torch.complex64 else 1e-13
    for param, reference in zip(fused_params, torch_params, strict=True):
        torch.testing.assert_close(param, reference, rtol=tolerance, atol=tolerance)
    # Moments in the param's complex dtype, as torch keeps them: state_dicts load either way.
    for key, state in fused.state[fused_params[0]].items():
        if key != "step":
            assert state.dtype == dtype and state.shape == fused_params[0].shape, key


def float64_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


@pytest.mark.parametrize(
    ("make_opt", "make_torch_opt"),
    [
        pytest.param(
            lambda p: FusedAdamW(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01), id="fused-adamw"
        ),
        pytest.param(
            lambda p: FusedSGD(p, lr=0.05, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            id="fused-sgd",
        ),
        pytest.param(
            lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05), id="torch-sgd"
        ),
    ],
)
def test_float64_grads_under_the_scaler_match_torchs_scaler(make_opt, make_torch_opt) -> None:
    """float64 model, both scalers, an overflow on step 2: same weights, same scales."""
    model, reference = float64_model(0), float64_model(0)
    opt, torch_opt = make_opt(model.parameters()), make_torch_opt(reference.parameters())
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    generator = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        for net, optimizer, amp in ((model, opt, scaler), (reference, torch_opt, torch_scaler)):
            optimizer.zero_grad()
            amp.scale(net(x).square().mean()).backward()
            if step == 2:
                net[0].weight.grad[0, 0] = float("inf")
            amp.step(optimizer)
            amp.update()
        assert scaler.get_scale() == torch_scaler.get_scale()
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param, ref, rtol=1e-12, atol=1e-14)


def test_float64_grads_are_unscaled_like_torchs_unscale() -> None:
    grads = [torch.randn(5, 7, dtype=torch.float64), torch.randn(9, dtype=torch.float64).mul(1e300)]
    expected = [grad.clone() for grad in grads]
    found_inf, expected_found = torch.zeros(()), torch.zeros(())
    inv_scale = torch.tensor(2.0**-13)
    fusedamp.ops.unscale_(grads, found_inf, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
    for grad, reference in zip(grads, expected, strict=True):
        assert torch.equal(grad, reference)
    assert found_inf.item() == expected_found.item() == 0.0
    grads[1][3] = float("nan")
    fusedamp.ops.unscale_(grads, found_inf, inv_scale)
    assert found_inf.item() == 1.0


def test_named_params_are_accepted_like_torch() -> None:
    model = nn.Linear(4, 2)
    opt = FusedAdamW(model.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert "param_names" in opt.state_dict()["param_groups"][0]


def test_tensor_weight_decay_is_accepted_by_fused_sgd() -> None:
    fused_params, torch_params, _ = step_both(
        FusedSGD,
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9},
        small_param,
        weight_decay=torch.tensor(0.0),
    )
    for param, reference in zip(fused_params, torch_params, strict=True):
        torch.testing.assert_close(param, reference)


def test_version_has_one_source() -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.MULTILINE)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", fusedamp.__version__)
    try:
        installed = importlib.metadata.version("fusedamp")
    except importlib.metadata.PackageNotFoundError:
        return  # running from the source tree, not installed
    assert installed == fusedamp.__version__

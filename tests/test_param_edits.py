"""Half params changed outside step() (zero_, clamp_, copy_, p.data edits, a model's
load_state_dict, torch.optim steps on the same state) are where the next step starts, in every
master mode, per element ([note: edited params] in csrc/include/fusedamp/math/master.h)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from conftest import needs_cuda
from torch import Tensor, nn

from fusedamp.optim import FusedAdamW, FusedSGD, join_bf16_remainder

SIZES = (1, 15, 16, 17, 100, 1031)
MODES = [
    pytest.param(torch.bfloat16, True, id="bf16-master"),
    pytest.param(torch.float16, True, id="fp16-master"),
    pytest.param(torch.bfloat16, "remainder", id="bf16-remainder"),
]
OPTIMIZERS = [
    pytest.param(FusedAdamW, {"lr": 0.05, "weight_decay": 0.1}, id="adamw"),
    pytest.param(FusedSGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, id="sgd"),
]


def _random_like(param: Tensor, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(param.shape, generator=generator).to(param.dtype).to(param.device)


def _with_specials(param: Tensor) -> None:
    # Zeros of both signs (a stale negative remainder would join them into a NaN or a flipped
    # sign), values well inside the old range, and a masked-out (pruned) quarter.
    flat = param.view(-1)
    flat[0::4] = 0.0
    flat[1::8] = -0.0
    flat[2::8] *= 0.001


EDITS: dict[str, Callable[[Tensor], None]] = {
    "zero_": lambda p: p.detach().zero_(),
    "clamp_": lambda p: p.detach().clamp_(-0.01, 0.01),
    "copy_": lambda p: p.detach().copy_(_random_like(p, 7)),
    "p.data = t": lambda p: setattr(p, "data", _random_like(p, 8)),
    "p.data.zero_()": lambda p: p.data.zero_(),
    "zeros and pruning": lambda p: _with_specials(p.detach()),
}


def _bits(tensor: Tensor) -> Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _assert_bitwise(actual: Tensor, expected: Tensor) -> None:
    assert torch.equal(actual.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(_bits(actual[finite]), _bits(expected[finite]))


def _fp32_value(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor:
    state = optimizer.state[param]
    if "master_remainder" in state:
        return join_bf16_remainder(param, state["master_remainder"])
    return state["master"]


def _expected_start(param: Tensor, old_master: Tensor, mode: bool | str) -> Tensor:
    """The rule of [note: edited params], written with torch ops."""
    if mode == "remainder":
        high = param.detach().cpu().view(torch.int16).int() & 0xFFFF
        remainder = old_master.cpu().int()
        magnitude = high & 0x7FFF
        edited = ((magnitude == 0) & (remainder < 0)) | ((magnitude == 0x7F80) & (remainder > 0))
        bits = (high << 16) + torch.where(edited, 0, remainder)
        return bits.view(torch.float32).to(param.device)
    unchanged = _bits(old_master.to(param.dtype)) == _bits(param.detach())
    return torch.where(unchanged, old_master, param.detach().float())


def _master_state(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor:
    state = optimizer.state[param]
    return state["master_remainder"] if "master_remainder" in state else state["master"]


def _run_edit_case(device: str, dtype: torch.dtype, mode: bool | str, fused_cls, options, edit) -> None:
    params = [nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in SIZES]
    optimizer = fused_cls(params, **options, master_weights=mode)
    for seed in range(2):
        for param in params:
            param.grad = _random_like(param, 100 + seed + param.numel())
        optimizer.step()
    for param in params:
        edit(param)
    # The reference: an fp32-param optimizer (same kernel math, no master) on the values the
    # rule says the step starts from, with the same moments.
    starts = [_expected_start(p, _master_state(optimizer, p), mode) for p in params]
    reference_params = [nn.Parameter(start.clone()) for start in starts]
    reference = fused_cls(reference_params, **options)
    for param, reference_param in zip(params, reference_params, strict=True):
        reference.state[reference_param] = {
            key: copy.deepcopy(value)
            for key, value in optimizer.state[param].items()
            if key not in ("master", "master_remainder")
        }
    for param, reference_param in zip(params, reference_params, strict=True):
        param.grad = _random_like(param, 200 + param.numel())
        reference_param.grad = param.grad.float()
    optimizer.step()
    reference.step()
    for param, reference_param in zip(params, reference_params, strict=True):
        _assert_bitwise(_fp32_value(optimizer, param), reference_param.detach())
        if mode is True:
            _assert_bitwise(param.detach(), reference_param.detach().to(dtype))


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
@pytest.mark.parametrize(("fused_cls", "options"), OPTIMIZERS)
@pytest.mark.parametrize(("dtype", "mode"), MODES)
def test_edited_params_are_where_the_next_step_starts(cpu_isa, dtype, mode, fused_cls, options, edit) -> None:
    _run_edit_case("cpu", dtype, mode, fused_cls, options, edit)


@needs_cuda
@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
@pytest.mark.parametrize(("dtype", "mode"), MODES)
def test_edited_params_are_where_the_next_step_starts_cuda(dtype, mode, edit) -> None:
    _run_edit_case("cuda", dtype, mode, FusedAdamW, {"lr": 0.05, "weight_decay": 0.1}, edit)


def _every_bf16_pattern_with(remainders: list[int]) -> tuple[Tensor, Tensor]:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    high = patterns.repeat(len(remainders)).view(torch.bfloat16)
    low = torch.tensor(remainders, dtype=torch.int16).repeat_interleave(patterns.numel())
    return high, low


def test_remainder_joins_every_edited_bf16_param_like_the_rule(cpu_isa) -> None:
    """Every bf16 pattern (zeros, subnormals, infs, NaNs) under stale remainders of both signs,
    through the optimizer kernel (the staged join) and the join op: the rule, bitwise."""
    high, low = _every_bf16_pattern_with([-0x8000, -1, 0, 1, 0x7FFF, -1234])
    param = nn.Parameter(high.clone())
    optimizer = FusedSGD([param], lr=0.0, master_weights="remainder")
    optimizer.state[param] = {"momentum_buffer": None, "master_remainder": low.clone()}
    expected = _expected_start(param, low, "remainder")
    _assert_bitwise(join_bf16_remainder(high, low), expected)
    param.grad = torch.ones_like(param)
    optimizer.step()
    _assert_bitwise(_fp32_value(optimizer, param), expected)
    assert not expected[~high.isnan()].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_master_rule_on_every_half_param(cpu_isa, dtype) -> None:
    """Every half pattern as an edited param against masters it is and is not the rounding of."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = patterns.float()[~patterns.isnan()]
    near = finite * (1 + 2.0**-12 * torch.randn(finite.shape, generator=torch.Generator().manual_seed(3)))
    masters = torch.cat([finite, near, near.flip(0)])
    params = torch.cat([finite, finite, finite]).to(dtype)
    params[::97] = patterns[: params[::97].numel()]  # NaN patterns among the params too
    param = nn.Parameter(params.clone())
    optimizer = FusedSGD([param], lr=0.0, master_weights=True)
    optimizer.state[param] = {"momentum_buffer": None, "master": masters.clone()}
    expected = _expected_start(param, masters, True)
    param.grad = torch.ones_like(param)
    optimizer.step()
    _assert_bitwise(optimizer.state[param]["master"], expected)


def test_clamped_bf16_params_stay_clamped_like_torch() -> None:
    """A clamp to 0.01 after a step, then one more step with lr 1e-3."""
    torch.manual_seed(0)
    results = {}
    for name, cls in (("torch", torch.optim.AdamW), ("fusedamp", FusedAdamW)):
        model = nn.Linear(64, 64).to(torch.bfloat16)
        optimizer = cls(model.parameters(), lr=1e-3)
        for _ in range(2):
            model(torch.randn(8, 64, dtype=torch.bfloat16)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for param in model.parameters():
                    param.clamp_(-0.01, 0.01)
        model(torch.randn(8, 64, dtype=torch.bfloat16)).square().sum().backward()
        optimizer.step()
        results[name] = max(p.abs().max().item() for p in model.parameters())
    assert results["fusedamp"] <= 0.0115
    assert results["fusedamp"] == pytest.approx(results["torch"], abs=2e-4)


@pytest.mark.parametrize("mode", [True, "remainder"])
def test_model_load_state_dict_rolls_back_half_params(mode) -> None:
    model = nn.Sequential(nn.Linear(16, 33), nn.Linear(33, 5)).to(torch.bfloat16)
    saved = copy.deepcopy(model.state_dict())
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    zero_biases = copy.deepcopy(model.state_dict())
    optimizer = FusedAdamW(model.parameters(), lr=1e-2, master_weights=mode)
    for _ in range(3):
        model(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.load_state_dict(saved)
    model(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    for name, param in model.named_parameters():
        # One AdamW step from the restored values: at most lr (plus decay) away, never NaN.
        assert not param.isnan().any(), name
        restored = saved[name].float()
        assert (param.float() - restored).abs().max() <= 1.1e-2 + 1e-2 * restored.abs().max()
    model.load_state_dict(zero_biases)
    optimizer.zero_grad()
    model(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    assert all(not p.isnan().any() for p in model.parameters())


def test_fused_torch_fused_round_trip_keeps_torchs_steps() -> None:
    """A state dict that goes FusedAdamW -> torch.optim.AdamW -> FusedAdamW: torch carries the
    "master" entry along untouched, and the next fused step starts from torch's params."""
    torch.manual_seed(1)
    model = nn.Linear(32, 17).to(torch.bfloat16)
    fused = FusedAdamW(model.parameters(), lr=1e-2)

    def train(optimizer: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(8, 32, dtype=torch.bfloat16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(fused, 3)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(fused.state_dict())
    train(plain, 5)
    after_torch = [p.detach().clone() for p in model.parameters()]
    resumed = FusedAdamW(model.parameters(), lr=1e-2)
    resumed.load_state_dict(plain.state_dict())
    train(resumed, 1)
    for before, param in zip(after_torch, model.parameters(), strict=True):
        # One step of lr 1e-2 from torch's params, not a jump back to the fused masters.
        assert (param.float() - before.float()).abs().max() <= 1.2e-2

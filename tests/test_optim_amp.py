"""FusedAdamW / FusedSGD under loss scaling: unscale and inf-skip in the step, fused clipping,
the grad write-back option and the read-only pass that fusedamp.GradScaler drives."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import Tensor

import fusedamp
import fusedamp.optim._base
import fusedamp.optim._clipping
import fusedamp.optim._plan
from fusedamp.optim import FusedAdamW, FusedSGD

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIMIZERS = [
    pytest.param(FusedAdamW, {"lr": 1.0, "betas": (0.1, 0.25), "amsgrad": True}, id="adamw"),
    pytest.param(FusedSGD, {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1}, id="sgd"),
]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def random_grads(params: list[Tensor], generator: torch.Generator, scale: float = 1.0) -> list[Tensor]:
    return [(torch.randn(p.shape, generator=generator) * scale).to(p.dtype) for p in params]


def make_params(dtype: torch.dtype, sizes: tuple[int, ...] = (7, 0, 22, 4099)) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator).to(dtype).requires_grad_() for n in sizes]


def snapshot(opt: torch.optim.Optimizer, params: list[Tensor]) -> bytes:
    """Every param, grad and state tensor of ``opt``, serialized: equal bytes = bitwise equal."""
    buffer = io.BytesIO()
    torch.save({"params": params, "grads": [p.grad for p in params], "state": opt.state_dict()}, buffer)
    return buffer.getvalue()


def scaled_step(opt: torch.optim.Optimizer, scale: float, found_inf: float = 0.0) -> None:
    """Drives step() as a GradScaler does: attributes set before, removed after."""
    opt.grad_scale = torch.tensor(scale)
    opt.found_inf = torch.tensor(found_inf)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_scaled_step_equals_unscaled_step_and_leaves_unscaled_grads(cls, options, dtype) -> None:
    # A power-of-two scale unscales exactly, so both runs must agree bitwise.
    plain_params, scaled_params = make_params(dtype), make_params(dtype)
    plain, scaled = cls(plain_params, **options), cls(scaled_params, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        grads = random_grads(plain_params, generator)
        for plain_param, scaled_param, grad in zip(plain_params, scaled_params, grads, strict=True):
            plain_param.grad = grad.clone()
            scaled_param.grad = grad * 1024.0
        plain.step()
        scaled_step(scaled, 1024.0)
        for scaled_param, grad in zip(scaled_params, grads, strict=True):
            assert torch.equal(scaled_param.grad, grad)
    assert snapshot(plain, plain_params) == snapshot(scaled, scaled_params)


@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_any_scale_unscales_like_torch(cls, options) -> None:
    # torch multiplies by the fp32 rounding of the fp64 reciprocal; so does the fused step.
    scale = 3000.0
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    plain_params, scaled_params = make_params(torch.float32), make_params(torch.float32)
    plain, scaled = cls(plain_params, **options), cls(scaled_params, **options)
    generator = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = random_grads(plain_params, generator, scale)
        for plain_param, scaled_param, grad in zip(plain_params, scaled_params, grads, strict=True):
            plain_param.grad = grad * inv
            scaled_param.grad = grad
        plain.step()
        scaled_step(scaled, scale)
    assert snapshot(plain, plain_params) == snapshot(scaled, scaled_params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_grads_are_left_as_torchs_unscale_leaves_them(dtype: torch.dtype) -> None:
    scale = 3000.0
    params = make_params(dtype)
    grads = random_grads(params, torch.Generator().manual_seed(3), scale)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    scaled_step(FusedAdamW(params), scale)
    torch._amp_foreach_non_finite_check_and_unscale_(
        grads, torch.zeros(()), torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    )
    for param, grad in zip(params, grads, strict=True):
        assert torch.equal(param.grad, grad)


@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_write_unscaled_grads_false_leaves_the_scaled_grads(cls, options) -> None:
    on_params, off_params = make_params(torch.float16), make_params(torch.float16)
    on = cls(on_params, **options, max_grad_norm=1.0)
    off = cls(off_params, **options, max_grad_norm=1.0, write_unscaled_grads=False)
    generator = torch.Generator().manual_seed(3)
    grads = random_grads(on_params, generator, 256.0)
    for on_param, off_param, grad in zip(on_params, off_params, grads, strict=True):
        on_param.grad, off_param.grad = grad.clone(), grad.clone()
    scaled_step(on, 256.0)
    scaled_step(off, 256.0)
    for on_param, off_param, grad in zip(on_params, off_params, grads, strict=True):
        assert torch.equal(off_param.grad, grad)
        assert torch.equal(on.master_of(on_param), off.master_of(off_param))
        if grad.numel():
            assert not torch.equal(on_param.grad, grad)


@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_inf_or_nan_skips_the_whole_step_bitwise(cls, options, dtype, master_weights) -> None:
    params = make_params(dtype)
    opt = cls(params, **options, master_weights=master_weights, max_grad_norm=1.0)
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        for param, grad in zip(params, random_grads(params, generator), strict=True):
            param.grad = grad
        opt.step()
    for bad in (float("inf"), float("nan")):
        for param, grad in zip(params, random_grads(params, generator, 64.0), strict=True):
            param.grad = grad
        params[2].grad[5] = bad
        before = snapshot(opt, params)
        scaled_step(opt, 64.0, found_inf=1.0)
        assert snapshot(opt, params) == before
    assert all(opt.state[p]["step"].item() == 3.0 for p in params)


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("found_inf", [2.0, -1.0, math.nan])
def test_any_found_inf_but_zero_skips_the_step(cls, dtype, found_inf) -> None:
    # found_inf may be a count or a sum over devices or ranks (> 1), or NaN itself: anything
    # but 0 skips, state and step counts included.
    param = torch.ones(3, dtype=dtype, requires_grad=True)
    param.grad = torch.ones(3, dtype=dtype)
    opt = cls([param], lr=0.1)
    opt.step()
    before = snapshot(opt, [param])
    scaled_step(opt, 1.0, found_inf=found_inf)
    assert snapshot(opt, [param]) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("cls", "torch_cls", "options"),
    [
        (FusedAdamW, torch.optim.AdamW, {"lr": 0.1}),
        (FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
)
def test_torch_grad_scaler_drives_the_fused_step(cls, torch_cls, options, dtype) -> None:
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).to(dtype)
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    fused = cls(model.parameters(), **options)
    ref = torch_cls(ref_model.parameters(), **options, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(6):
        x = torch.randn(8, 16)
        if step == 3:
            x[0, 0] = float("inf")  # overflow: the step is skipped and the scale backs off
        scaler.scale(model(x.to(dtype)).float().square().mean()).backward()
        scaler.step(fused)
        scaler.update()
        if step != 3:
            # After the step the grads hold the unscaled values it used: feed them to torch.
            for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
                ref_param.grad = param.grad.float()
            ref.step()
        fused.zero_grad()
    assert scaler.get_scale() == 2.0**9
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(fused.master_of(param), ref_param.detach(), **TOLERANCE)
        assert fused.state[param]["step"].item() == 5.0


def ref_grads_from(model: torch.nn.Module, ref_model: torch.nn.Module, x: Tensor, dtype: torch.dtype) -> None:
    """Puts the unscaled grads of ``model`` at ``x`` (computed in its dtype) into ``ref_model``."""
    grads = torch.autograd.grad(model(x.to(dtype)).float().square().mean(), list(model.parameters()))
    for ref_param, grad in zip(ref_model.parameters(), grads, strict=True):
        ref_param.grad = grad.float()


# --- fused clipping ------------------------------------------------------------------------


def clipped_reference(
    cls: type, options: dict[str, Any], dtype: torch.dtype, max_norm: float, scale: float | None
) -> tuple[torch.optim.Optimizer, list[Tensor], list[Tensor]]:
    """Runs the fused optimizer (max_grad_norm) and torch's clip_grad_norm_ + optimizer side by side."""
    torch_cls = torch.optim.AdamW if cls is FusedAdamW else torch.optim.SGD
    params = make_params(dtype)
    refs = [p.detach().float().requires_grad_() for p in params]
    fused = cls(params, **options, max_grad_norm=max_norm)
    ref = torch_cls(refs, **options, foreach=False)
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        grads = random_grads(params, generator, 3.0)
        for param, ref_param, grad in zip(params, refs, grads, strict=True):
            param.grad = grad.clone() if scale is None else grad * scale
            ref_param.grad = grad.float()
        if scale is None:
            fused.step()
        else:
            scaled_step(fused, scale)
        norm = torch.nn.utils.clip_grad_norm_(refs, max_norm)
        ref.step()
        torch.testing.assert_close(fused.last_grad_norm, norm, rtol=1e-5, atol=0.0)
        for param, ref_param in zip(params, refs, strict=True):
            # The step leaves the unscaled, clipped grads, as clip_grad_norm_ does.
            expected = ref_param.grad.to(dtype).float()
            rtol = max(torch.finfo(dtype).eps, 1e-5)
            torch.testing.assert_close(param.grad.float(), expected, rtol=rtol, atol=1e-5)
    return fused, params, refs


@pytest.mark.parametrize("scale", [None, 512.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_max_grad_norm_clips_like_clip_grad_norm(cls, options, dtype, scale) -> None:
    fused, params, refs = clipped_reference(cls, options, dtype, max_norm=1.5, scale=scale)
    for param, ref_param in zip(params, refs, strict=True):
        torch.testing.assert_close(fused.master_of(param), ref_param.detach(), **TOLERANCE)
    assert fused.last_grad_norm.dtype == torch.float32 and fused.last_grad_norm.dim() == 0


def test_infinite_max_grad_norm_measures_without_changing_the_step() -> None:
    plain_params, measured_params = make_params(torch.float32), make_params(torch.float32)
    plain = FusedAdamW(plain_params)
    measured = FusedAdamW(measured_params, max_grad_norm=float("inf"))
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for plain_param, measured_param, grad in zip(
            plain_params, measured_params, random_grads(plain_params, generator), strict=True
        ):
            plain_param.grad, measured_param.grad = grad.clone(), grad.clone()
        plain.step()
        measured.step()
        expected = torch.linalg.vector_norm(torch.cat([p.grad for p in plain_params]))
        torch.testing.assert_close(measured.last_grad_norm, expected)
    assert plain.last_grad_norm is None
    assert snapshot(plain, plain_params) == snapshot(measured, measured_params)


def test_fusedamp_check_grads_is_the_only_read_pass(monkeypatch) -> None:
    calls: list[str] = []
    real_check = fusedamp.optim._clipping.ops.check_and_norm_

    def check(*args: Any) -> None:
        calls.append("check_and_norm_")
        real_check(*args)

    monkeypatch.setattr(fusedamp.optim._clipping.ops, "check_and_norm_", check)
    real_op_call = fusedamp.optim._plan.op_call
    monkeypatch.setattr(  # the step plan's read-only pass
        fusedamp.optim._plan, "op_call", lambda op, *args: recorder(calls, op, real_op_call(op, *args))
    )
    params = make_params(torch.float16)
    opt = FusedAdamW(params, max_grad_norm=0.5)
    generator = torch.Generator().manual_seed(8)
    for param, grad in zip(params, random_grads(params, generator, 128.0), strict=True):
        param.grad = grad
    scaled_grads = [p.grad.clone() for p in params]

    found = opt._fusedamp_check_grads(torch.tensor(1 / 128.0))
    assert list(found) == [torch.device("cpu")] and found[torch.device("cpu")].item() == 0.0
    assert all(torch.equal(p.grad, g) for p, g in zip(params, scaled_grads, strict=True))
    expected_norm = torch.linalg.vector_norm(torch.cat([g.float() / 128.0 for g in scaled_grads]))
    torch.testing.assert_close(opt.last_grad_norm, expected_norm)

    opt.grad_scale, opt.found_inf = torch.tensor(128.0), found[torch.device("cpu")]
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert calls == ["check_and_norm_"]
    clipped_norm = torch.linalg.vector_norm(torch.cat([p.grad.float() for p in params]))
    torch.testing.assert_close(clipped_norm, torch.tensor(0.5), rtol=1e-2, atol=0.0)

    # Without a preceding check the step takes the norm itself (a torch.amp.GradScaler, no scaler).
    for param, grad in zip(params, random_grads(params, generator), strict=True):
        param.grad = grad
    opt.step()
    assert calls == ["check_and_norm_"] * 2


def test_fusedamp_check_grads_reports_inf_per_device() -> None:
    params = make_params(torch.bfloat16)
    opt = FusedSGD(params)
    for param in params:
        param.grad = torch.ones_like(param)
    params[3].grad[-1] = float("nan")
    first = opt._fusedamp_check_grads(torch.tensor(1.0))
    second = opt._fusedamp_check_grads(torch.tensor(1.0))
    cpu = torch.device("cpu")
    assert first[cpu].item() > 0 and second[cpu].item() > 0 and first[cpu] is not second[cpu]
    assert opt.last_grad_norm is None


def test_fusedamp_grad_scaler_makes_one_read_pass_and_one_step(monkeypatch) -> None:
    grad_scaler = pytest.importorskip("fusedamp.grad_scaler")
    calls: list[str] = []
    for module, name in (
        (fusedamp.optim._clipping.ops, "check_and_norm_"),
        (fusedamp.optim._clipping.ops, "unscale_"),
    ):
        monkeypatch.setattr(module, name, recorder(calls, name, getattr(module, name)))
    for module in (fusedamp.optim._base, fusedamp.optim._plan):  # the step plan's op calls
        real = module.op_call
        monkeypatch.setattr(
            module, "op_call", lambda op, *args, real=real: recorder(calls, op, real(op, *args))
        )
    torch.manual_seed(9)
    model = torch.nn.Linear(32, 8).to(torch.bfloat16)
    ref_model = torch.nn.Linear(32, 8)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = FusedAdamW(model.parameters(), lr=0.1, max_grad_norm=0.25)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.1, foreach=False)
    scaler = grad_scaler.GradScaler("cpu", init_scale=2.0**8)
    for _ in range(3):
        x = torch.randn(4, 32)
        calls.clear()
        scaler.scale(model(x.bfloat16()).float().square().mean()).backward()
        ref_grads_from(model, ref_model, x, torch.bfloat16)
        scaler.step(opt)
        scaler.update()
        assert calls == ["check_and_norm_", "adamw_"]
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.25)
        torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-5, atol=0.0)
        ref.step()
        opt.zero_grad()
    for param, ref_param in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(opt.master_of(param), ref_param.detach(), **TOLERANCE)


def recorder(calls: list[str], name: str, function: Any) -> Any:
    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(name)
        function(*args, **kwargs)

    return record


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fusedamp.build_info()["cuda_compiled"]),
    reason="needs a GPU and fusedamp's CUDA kernels",
)
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_cuda_scaled_step_never_syncs_with_the_host(cls, options, clip) -> None:
    model = torch.nn.Linear(64, 64).cuda().half()
    opt = cls(model.parameters(), **options, max_grad_norm=clip)
    scale = torch.tensor(2.0**12, device="cuda")
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    for _ in range(3):
        (model(x).float().square().mean() * scale).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.grad_scale, opt.found_inf = scale, torch.zeros((), device="cuda")
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            del opt.grad_scale, opt.found_inf
        opt.zero_grad()
    assert all(opt.state[p]["step"].item() == 3.0 for p in model.parameters())

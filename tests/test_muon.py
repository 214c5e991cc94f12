"""FusedMuon against torch.optim.Muon (and a float64 reference of its math), in every fusedamp
mode: masters, bf16 / 8-bit momentum over long runs, the AMP step (scalers, clipping, skipped
steps), state dicts both ways and resumes, the AdamW groups, the param-group helper, errors;
CUDA against CPU where a GPU is present."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SUPPORTED_CPU_ISAS, needs_baseline_kernels, needs_cuda
from torch import nn

import fusedamp
from fusedamp import _C
from fusedamp.optim import FusedMuon, muon_param_groups
from fusedamp.optim.muon import orthogonalize

# Square, tall and wide matrices, odd sizes, two of one shape (one batch), a 1-row and a 1-column
# one; 97 x 70 spans more than one CPU chunk of the momentum kernel at 1 thread.
SHAPES = [(16, 16), (33, 7), (7, 33), (33, 7), (1, 5), (5, 1), (97, 700)]
NS = (3.4445, -4.775, 2.0315)


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 0.1).to(dtype).requires_grad_() for shape in SHAPES]


def set_grads(params: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-2 * scale).to(param.dtype)


def run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        set_grads(params, step)
        opt.step()


def reference_muon(
    params: list[torch.Tensor], steps: int, lr: float, weight_decay: float, momentum: float, nesterov: bool,
    adjust_lr_fn: str | None, ns_steps: int = 5,
) -> list[torch.Tensor]:
    """torch.optim.Muon's algorithm in float64 throughout (its orthogonalization included)."""
    values = [param.detach().double().clone() for param in params]
    buffers = [torch.zeros_like(value) for value in values]
    for step in range(steps):
        set_grads(params, step)
        for value, buffer, param in zip(values, buffers, params, strict=True):
            grad = param.grad.double()
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if nesterov else buffer
            update = orthogonalize(update.unsqueeze(0), NS, ns_steps, 1e-7)[0]
            rows, cols = value.shape
            ratio = {
                None: math.sqrt(max(1, rows / cols)),
                "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
                "spectral_unclamped": math.sqrt(rows / cols),
            }[adjust_lr_fn]
            value.mul_(1 - lr * weight_decay).add_(update, alpha=-lr * ratio)
    return values


def max_relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference of a tensor of ``a`` from its twin in ``b``, relative to the twin's
    largest element."""
    pairs = zip(a, b, strict=True)
    return max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item() for x, y in pairs)


def relative_displacement(params: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """max_relative of the displacements from make_params()'s start."""
    start = make_params(params[0].dtype)
    ours = [p - q for p, q in zip(params, start, strict=True)]
    return max_relative(ours, [p - q for p, q in zip(theirs, start, strict=True)])


# --- the math against torch.optim.Muon and a float64 reference -------------------------------


def test_orthogonalize_matches_torch_per_matrix() -> None:
    """The batched orthogonalization is torch.optim.Muon's per-matrix one, within bf16 rounding."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    generator = torch.Generator().manual_seed(3)
    for shape in [(16, 16), (33, 7), (7, 33), (1, 5)]:
        batch = torch.randn(3, *shape, generator=generator)
        ours = orthogonalize(batch.bfloat16(), NS, 5, 1e-7)
        for matrix, result in zip(batch, ours, strict=True):
            expected = _zeropower_via_newtonschulz(matrix, NS, 5, 1e-7)
            assert result.dtype == expected.dtype == torch.bfloat16
            torch.testing.assert_close(result.float(), expected.float(), rtol=2**-6, atol=2**-7)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw", "spectral_unclamped"])
def test_fp32_orthogonalization_matches_float64_reference(nesterov: bool, adjust_lr_fn: str | None) -> None:
    """ns_dtype=float32: 30 steps within fp32 error of the float64 algorithm."""
    params = make_params()
    opt = fusedamp.FusedMuon(
        params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
        ns_dtype=torch.float32,
    )
    expected = reference_muon(params, 30, 0.02, 0.1, 0.9, nesterov, adjust_lr_fn)
    run(opt, params, 30)
    for param, value in zip(params, expected, strict=True):
        torch.testing.assert_close(param.detach().double(), value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(nesterov: bool) -> None:
    """The defaults (bf16 orthogonalization): 30 steps of fp32 params track torch.optim.Muon
    within the bf16 rounding of its orthogonalized updates, and buffers match to fp32 error."""
    params, theirs = make_params(), make_params()
    ours_opt = fusedamp.FusedMuon(params, lr=0.02, nesterov=nesterov)
    torch_opt = torch.optim.Muon(theirs, lr=0.02, nesterov=nesterov)
    for step in range(30):
        set_grads(params, step)
        set_grads(theirs, step)
        ours_opt.step()
        torch_opt.step()
    displacement = relative_displacement(params, theirs)
    assert displacement < 2e-2, displacement
    for param, other in zip(params, theirs, strict=True):
        torch.testing.assert_close(
            ours_opt.state[param]["momentum_buffer"], torch_opt.state[other]["momentum_buffer"], rtol=1e-2,
            atol=1e-6,
        )


def test_float64_params_step_as_torch_muon() -> None:
    """float64 params (no fused kernel) take torch's ops in its order, the orthogonalization as a
    batch of one: torch.optim.Muon's result within the bf16 rounding of the updates."""
    params, theirs = make_params(torch.float64), make_params(torch.float64)
    ours_opt, torch_opt = fusedamp.FusedMuon(params, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for step in range(10):
        set_grads(params, step)
        set_grads(theirs, step)
        ours_opt.step()
        torch_opt.step()
    assert all(param.dtype == torch.float64 for param in params)
    assert relative_displacement(params, theirs) < 2e-2


@needs_baseline_kernels
@pytest.mark.parametrize("isa", SUPPORTED_CPU_ISAS)
@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_bitwise_across_isas_and_threads(isa: str, moments: str) -> None:
    """Every CPU ISA build and thread count steps the momentum (and its codes) to the same bits."""
    results = []
    for chosen, threads in [("baseline", 1), (isa, 1), (isa, 2)]:
        previous_isa, previous_threads = _C.set_cpu_isa(chosen), torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            params = make_params(torch.bfloat16)
            opt = fusedamp.FusedMuon(params, lr=0.02, moments=moments, master_weights="remainder")
            run(opt, params, 4)
            results.append([*params, *(t for s in opt.state.values() for t in s.values())])
        finally:
            _C.set_cpu_isa(previous_isa)
            torch.set_num_threads(previous_threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


# --- fusedamp's modes over long runs ---------------------------------------------------------

LONG_STEPS = 2000


def steady_run(
    moments: str,
    dtype: torch.dtype,
    master_weights: object,
    lr: float,
    momentum: float = 0.95,
    noise: float = 0.5,
) -> torch.Tensor:
    """The displacement of a 32 x 16 matrix after LONG_STEPS steps of a steady-sign gradient with
    noise (`noise` times its size)."""
    generator = torch.Generator().manual_seed(5)
    start = (torch.randn(32, 16, generator=generator) * 0.1).to(dtype)
    sign = torch.randn(32, 16, generator=generator).sign()
    param = start.clone().requires_grad_()
    opt = fusedamp.FusedMuon(
        [param], lr=lr, weight_decay=0.0, momentum=momentum, moments=moments, master_weights=master_weights
    )
    noise_generator = torch.Generator().manual_seed(9)
    for _ in range(LONG_STEPS):
        param.grad = (sign + noise * torch.randn(32, 16, generator=noise_generator)).to(dtype)
        opt.step()
    return (param.detach().float() - start.float()).flatten()


@functools.cache
def fp32_run(lr: float, momentum: float = 0.95, noise: float = 0.5) -> torch.Tensor:
    return steady_run("fp32", torch.float32, True, lr, momentum, noise)


def projection(moved: torch.Tensor, reference: torch.Tensor) -> float:
    """A displacement projected on the fp32 FusedMuon's (fp32 params and momentum): 1.0 is the
    same step."""
    return (moved @ reference / (reference @ reference)).item()


@pytest.mark.parametrize(
    ("moments", "dtype", "master_weights"),
    [
        ("int8", torch.float32, True),
        ("bf16", torch.float32, True),
        ("int8", torch.bfloat16, "remainder"),
        ("int8", torch.bfloat16, "stochastic"),
        ("fp32", torch.bfloat16, True),
    ],
)
@pytest.mark.parametrize("lr", [1e-3, 1e-5])
def test_long_runs_track_fp32(moments: str, dtype: torch.dtype, master_weights: object, lr: float) -> None:
    ratio = projection(steady_run(moments, dtype, master_weights, lr), fp32_run(lr))
    assert abs(ratio - 1.0) < 0.03, ratio


def test_int8_buffer_roundings_cancel_over_steps() -> None:
    """Muon's buffer rounds with dithered draws ([note: dithered draws] in math/stochastic.h): each
    rounding is unbiased, and an element's roundings of a held value average out over the steps.
    At momentum 0 the buffer is stored from the same grad every step: the average of 64 stored
    values comes within 1.5% of a code step of the grad, and over the elements the roundings are
    unbiased."""
    n = 4096
    generator = torch.Generator().manual_seed(3)
    # One binade, [1, 2), the top of every block (narrow codes: a step is scale / 64 in the top
    # binade of the scale, scale / 128 in the one below).
    sign = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    grad = sign * (1.0 + torch.rand(n, generator=generator))
    codes = torch.zeros(n, dtype=torch.uint8)
    scales = torch.zeros(n // 256, dtype=torch.bfloat16)
    update = torch.empty(n)
    total = torch.zeros(n, dtype=torch.float64)
    steps = 64
    for step in range(steps):
        fusedamp.ops.muon_momentum_(
            [update], [grad], [codes], [torch.tensor(float(step))], momentum=0.0,
            momentum_buffer_scales=[scales], rounding_ids=[0], rounding_seed=11,
        )
        total += fusedamp.ops.decode_state(codes, scales, True).double()
    scale = scales.double().abs().repeat_interleave(256)
    step_size = torch.where(grad.abs() >= scale / 2, scale / 64, scale / 128)
    error = (total / steps - grad.double()) / step_size  # in code steps
    assert error.abs().mean() < 0.015, error.abs().mean()
    assert error.abs().max() < 0.1, error.abs().max()
    assert abs(error.mean()) < 0.003, error.mean()


@pytest.mark.parametrize(("dtype", "master_weights"), [(torch.float32, True), (torch.bfloat16, "stochastic")])
def test_int8_buffers_track_fp32_at_momentum_099_with_noisy_grads(
    dtype: torch.dtype, master_weights: object
) -> None:
    """A buffer that keeps 99% of itself per step gathers the noise of its roundings, which the
    orthogonalization passes on to the step; with dithered draws it stays within 3% of fp32's (the
    long-run figures of docs/muon.md)."""
    moved = steady_run("int8", dtype, master_weights, 1e-3, momentum=0.99, noise=3.0)
    ratio = projection(moved, fp32_run(1e-3, momentum=0.99, noise=3.0))
    assert abs(ratio - 1.0) < 0.03, ratio


# --- AMP: scalers, clipping, skipped steps ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaler_kind", ["fusedamp", "torch"])
@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_scaled_step_equals_plain_and_overflow_changes_nothing(
    scaler_kind: str, moments: str, dtype: torch.dtype
) -> None:
    """Under either GradScaler, a step on scaled grads equals the plain step (the scale is a power
    of two: unscaling is exact; fp16 grads: to its rounding of subnormals), and a step with an inf
    grad leaves params and state bitwise. fp16 params take their updates in fp32 (the kernels do
    not pair fp16 with bf16)."""
    params, plain = make_params(dtype), make_params(dtype)
    opt = fusedamp.FusedMuon(params, lr=0.02, moments=moments)
    plain_opt = fusedamp.FusedMuon(plain, lr=0.02, moments=moments)
    scaler_class = fusedamp.GradScaler if scaler_kind == "fusedamp" else torch.amp.GradScaler
    scaler = scaler_class("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))  # a scaler starts its scale at its first scale() call
    for step in range(3):
        set_grads(params, step, scale=2.0**10)
        set_grads(plain, step)
        scaler.step(opt)
        scaler.update()
        plain_opt.step()
    for a, b in zip(params, plain, strict=True):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:  # the scaled grads' fp16 roundings differ where the plain ones are subnormal
            torch.testing.assert_close(a, b, rtol=2**-8, atol=1e-4)
    before = copy.deepcopy((params, opt.state_dict()["state"]))
    set_grads(params, 3, scale=2.0**10)
    params[2].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    for a, b in zip(params, before[0], strict=True):
        assert torch.equal(a, b)
    for key, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, before[1][key][name]), name


def test_max_grad_norm_clips_over_every_group_as_torch() -> None:
    """One clip over the Muon and the AdamW groups' grads: the step equals clip_grad_norm_ then
    an unclipped step."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    options = {"lr": 0.02, "ns_dtype": torch.float32}
    opt = fusedamp.FusedMuon(muon_param_groups(model), max_grad_norm=0.5, **options)
    twin_opt = fusedamp.FusedMuon(muon_param_groups(twin), **options)
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for net in (model, twin):
        net(inputs).square().sum().mul(10).backward()
    norm = nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert norm > 0.5
    opt.step()
    twin_opt.step()
    torch.testing.assert_close(opt.last_grad_norm, norm)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- masters and half params -----------------------------------------------------------------


@pytest.mark.parametrize("master_weights", [True, "remainder", "stochastic", False])
def test_half_params_track_the_fp32_run(master_weights: object) -> None:
    """bf16 params on the same grads as an fp32 run: fp32 and remainder masters hold the fp32 run's
    params bit for bit (the momentum, its bf16 update and the master update are the same math);
    stochastic rounding and plain bf16 stay near them."""
    params = make_params(torch.bfloat16)
    reference = [p.detach().float().requires_grad_() for p in params]
    opt = fusedamp.FusedMuon(params, lr=0.02, master_weights=master_weights)
    ref_opt = fusedamp.FusedMuon(reference, lr=0.02)
    for step in range(20):
        set_grads(params, step)
        for param, twin in zip(params, reference, strict=True):
            twin.grad = param.grad.float()
        opt.step()
        ref_opt.step()
    for param, twin in zip(params, reference, strict=True):
        state = opt.state[param]
        if master_weights is True:
            assert torch.equal(state["master"], twin)
        elif master_weights == "remainder":
            assert torch.equal(fusedamp.optim.join_bf16_remainder(param, state["master_remainder"]), twin)
    assert max_relative(params, reference) < (2**-7 if master_weights in (True, "remainder") else 2**-4)


# --- state dicts, resumes, torch's state -----------------------------------------------------


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_resume_is_bitwise(moments: str) -> None:
    params = make_params(torch.bfloat16)
    opt = fusedamp.FusedMuon(params, lr=0.02, moments=moments, master_weights="stochastic")
    run(opt, params, 3)
    saved = copy.deepcopy((params, opt.state_dict()))
    run(opt, params, 3, first=3)
    resumed = [p.detach().clone().requires_grad_() for p in saved[0]]
    resumed_opt = fusedamp.FusedMuon(resumed, lr=0.02, moments=moments, master_weights="stochastic")
    resumed_opt.load_state_dict(saved[1])
    run(resumed_opt, resumed, 3, first=3)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)


def test_torch_state_dict_both_ways() -> None:
    """torch.optim.Muon's state dict loads into FusedMuon (and continues as torch would), and
    torch_state_dict() loads into torch.optim.Muon, under the same key: momentum_buffer."""
    params, theirs = make_params(), make_params()
    torch_opt = torch.optim.Muon(theirs, lr=0.02)
    run(torch_opt, theirs, 3)
    ours = [t.detach().clone().requires_grad_() for t in theirs]
    opt = fusedamp.FusedMuon(ours, lr=0.02)
    opt.load_state_dict(torch_opt.state_dict())
    for param, other in zip(ours, theirs, strict=True):
        assert torch.equal(opt.state[param]["momentum_buffer"], torch_opt.state[other]["momentum_buffer"])
    exported = opt.torch_state_dict()
    assert set(exported["state"][0]) >= {"momentum_buffer"}
    back = torch.optim.Muon([t.detach().clone().requires_grad_() for t in theirs], lr=0.02)
    back.load_state_dict(exported)
    coded = fusedamp.FusedMuon(params, lr=0.02, moments="int8")
    run(coded, params, 2)
    decoded = coded.torch_state_dict()["state"][1]["momentum_buffer"]
    assert decoded.dtype == torch.float32 and decoded.shape == SHAPES[1]
    assert coded.state_bytes()["moments"] == sum(math.prod(s) for s in SHAPES)  # one byte per element


# --- one optimizer for a whole model ---------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.hidden = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.hidden(self.embed(tokens)))))


def test_param_groups_rule_and_override() -> None:
    model = TinyLM()
    muon, adamw = muon_param_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4})
    assert muon["use_muon"] and muon["lr"] == 0.02
    assert [id(p) for p in muon["params"]] == [id(model.hidden.weight)]
    assert not adamw["use_muon"] and adamw["lr"] == 3e-4
    assert {id(p) for p in adamw["params"]} == {
        id(p) for p in model.parameters() if p is not model.hidden.weight
    }
    custom = muon_param_groups(model, is_muon=lambda name, p: name == "out.weight")
    assert [id(p) for p in custom[0]["params"]] == [id(model.out.weight)]


def test_adamw_groups_step_as_fused_adamw() -> None:
    """The AdamW groups of a FusedMuon step exactly as FusedAdamW with the same options, in the same
    step() as the Muon groups; unset AdamW options take AdamW's defaults."""
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = fusedamp.FusedMuon(muon_param_groups(model, adamw={"lr": 3e-3}), lr=0.02)
    assert opt.param_groups[1]["eps"] == 1e-8 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    adamw = fusedamp.FusedAdamW([p for p in twin.parameters() if p is not twin.hidden.weight], lr=3e-3)
    tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for net in (model, twin):
            net.zero_grad()
            nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten()).backward()
        start = model.hidden.weight.detach().clone()
        opt.step()
        adamw.step()
        assert not torch.equal(model.hidden.weight, start)  # Muon stepped it
        with torch.no_grad():
            twin.hidden.weight.copy_(model.hidden.weight)  # the same forward at the next step
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_changing_hyperparameters_between_steps() -> None:
    """lr (a scheduler's), momentum, nesterov and weight decay are read at every step, as torch's."""
    params, theirs = make_params(), make_params()
    opt, torch_opt = fusedamp.FusedMuon(params, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    changes = [{}, {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.0, "nesterov": False}]
    for step, change in enumerate(changes):
        for optimizer, group_params in ((opt, params), (torch_opt, theirs)):
            optimizer.param_groups[0].update(change)
            set_grads(group_params, step)
            optimizer.step()
    for param, other in zip(params, theirs, strict=True):
        ours, expected = opt.state[param]["momentum_buffer"], torch_opt.state[other]["momentum_buffer"]
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)
    assert relative_displacement(params, theirs) < 2e-2


def test_tensor_lr() -> None:
    params, twin = make_params(), make_params()
    run(fusedamp.FusedMuon(params, lr=torch.tensor(0.02)), params, 3)
    run(fusedamp.FusedMuon(twin, lr=0.02), twin, 3)
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --- errors ----------------------------------------------------------------------------------


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"param 1 of group 0 has shape \(4,\); a Muon group takes 2-D"):
        fusedamp.FusedMuon([torch.zeros(3, 4, requires_grad=True), torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="Adjust learning rate function cubic is not supported"):
        fusedamp.FusedMuon([torch.zeros(3, 4, requires_grad=True)], adjust_lr_fn="cubic")
    with pytest.raises(ValueError, match="ns_dtype must be torch.bfloat16"):
        fusedamp.FusedMuon([torch.zeros(3, 4, requires_grad=True)], ns_dtype=torch.float16)
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        fusedamp.FusedMuon([torch.zeros(3, 4, requires_grad=True)], momentum=-1.0)
    with pytest.raises(ValueError, match="maximize=True is for AdamW groups"):
        fusedamp.FusedMuon([{"params": [torch.zeros(3, 4, requires_grad=True)], "maximize": True}])
    with pytest.raises(TypeError, match="Muon groups take real matrices"):
        fusedamp.FusedMuon([torch.zeros(3, 4, dtype=torch.complex64, requires_grad=True)])
    adamw_only = fusedamp.FusedMuon([{"params": [torch.zeros(4, requires_grad=True)], "use_muon": False}])
    adamw_only.param_groups[0]["betas"] = (1.0, 0.999)
    adamw_only.param_groups[0]["params"][0].grad = torch.zeros(4)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        adamw_only.step()


def test_int8_momentum_above_09999_warns_and_names_the_fix() -> None:
    """int8 buffers track fp32 ones within 0.03 up to momentum 0.9999 (the long-run figures of
    docs/muon.md) and were not measured above: there the optimizer says so, with the mode that
    tracks fp32; up to 0.9999, or with bf16 buffers, it is silent."""
    matrix = torch.zeros(8, 4, requires_grad=True)
    with pytest.warns(UserWarning, match=r"momentum=0.99999 \(param group 0\).*moments='bf16'"):
        fusedamp.FusedMuon([matrix], momentum=0.99999, moments="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fusedamp.FusedMuon([matrix], momentum=0.95, moments="int8")
        fusedamp.FusedMuon([matrix], momentum=0.995, moments="int8")
        fusedamp.FusedMuon([matrix], momentum=0.9999, moments="int8")
        fusedamp.FusedMuon([matrix], momentum=0.99999, moments="bf16")
        adamw_group = {"params": [torch.zeros(4, requires_grad=True)], "use_muon": False}
        fusedamp.FusedMuon([adamw_group], momentum=0.999, moments="int8")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group for the test, destroyed after it."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_params_are_refused_in_muon_groups(one_rank_group: None) -> None:
    """FSDP2 / tensor-parallel shards: Muon needs whole matrices; the error says what to do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
    with pytest.raises(NotImplementedError, match="DTensor .* does not gather sharded ones"):
        fusedamp.FusedMuon([param])
    fusedamp.FusedMuon([{"params": [param], "use_muon": False}])  # AdamW groups take them


def test_distributed_checkpoint_resume_is_bitwise(tmp_path: Path, one_rank_group: None) -> None:
    """DDP (one gloo rank) + torch.distributed.checkpoint: get_state_dict / dcp.save after 3 steps,
    a fresh model and optimizer dcp.load + set_state_dict it, and 3 more steps give the bits of the
    run that never stopped (int8 momentum and bf16 remainders included)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    def make() -> tuple[nn.Module, FusedMuon]:
        torch.manual_seed(0)
        model = DistributedDataParallel(TinyLM().to(torch.bfloat16))
        groups = muon_param_groups(model.module, adamw={"lr": 3e-3})
        return model, FusedMuon(groups, lr=0.02, moments="int8", master_weights="remainder")

    def train(model: nn.Module, opt: FusedMuon, steps: range) -> None:
        for step in steps:
            tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(step))
            nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    train(model, opt, range(3))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path))
    train(model, opt, range(3, 6))

    resumed, resumed_opt = make()
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(
        resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    train(resumed, resumed_opt, range(3, 6))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for state, other in zip(opt.state.values(), resumed_opt.state.values(), strict=True):
        assert state.keys() == other.keys()
        for key in state:
            assert torch.equal(state[key], other[key]), key


# --- CUDA ------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(
    ("dtype", "master_weights", "moments"),
    [
        (torch.float32, True, "fp32"),
        (torch.bfloat16, "remainder", "int8"),
        (torch.bfloat16, "stochastic", "bf16"),
        (torch.float16, True, "int8"),
    ],
)
@pytest.mark.parametrize("coded_runs", [1, 2])
def test_cuda_momentum_and_update_equal_cpu(
    dtype: torch.dtype, master_weights: object, moments: str, coded_runs: int
) -> None:
    """The fused kernels on CUDA give the CPU's bits (momentum codes, masters, params) with an fp32
    orthogonalization, whose matmuls differ between the devices only in rounding: the params are
    compared to that, the state exactly after the first step; in either layout of the coded CUDA
    kernels."""
    cpu = make_params(dtype)
    gpu = [p.detach().cuda().requires_grad_() for p in cpu]
    options = {"lr": 0.02, "master_weights": master_weights, "moments": moments, "ns_dtype": torch.float32}
    cpu_opt, gpu_opt = fusedamp.FusedMuon(cpu, **options), fusedamp.FusedMuon(gpu, **options)
    previous = fusedamp._C.set_cuda_launch_settings(coded_runs=coded_runs)
    try:
        for step in range(3):
            set_grads(cpu, step)
            for c, g in zip(cpu, gpu, strict=True):
                g.grad = c.grad.cuda()
            cpu_opt.step()
            gpu_opt.step()
            if step == 0:
                for c, g in zip(cpu, gpu, strict=True):
                    expected = cpu_opt.state[c]["momentum_buffer"]
                    assert torch.equal(gpu_opt.state[g]["momentum_buffer"].cpu(), expected)
    finally:
        fusedamp._C.set_cuda_launch_settings(**previous)
    for c, g in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(g.cpu().float(), c.float(), rtol=2**-6, atol=1e-5)

"""The coded optimizer modes ([note: state codecs]): bf16 / 8-bit moments and stochastically rounded
params in FusedAdamW and FusedSGD. Bitwise agreement across CPU ISA builds and thread counts, the
AMP guarantees (a found_inf step changes nothing, inv_scale and clipping inside the step, NaN
grads without a scaler propagate), resumes, state dicts (native, torch's, export, earlier
builds' checkpoints), errors."""

from __future__ import annotations

import copy
import itertools
import pathlib

import pytest
import torch
from conftest import SUPPORTED_CPU_ISAS, needs_cuda

import fusedamp
import fusedamp.ops as ops
from fusedamp import _C
from fusedamp.optim import _codecs, _dtensor_state

SIZES = [1, 255, 257, 4097, 70001]  # partial blocks; 70001 spans three CPU chunks (threads)
MODES = [  # (param dtype, master_weights, moments)
    (torch.float32, True, "int8"),
    (torch.float32, True, "bf16"),
    (torch.bfloat16, True, "int8"),
    (torch.bfloat16, "remainder", "int8"),
    (torch.bfloat16, "stochastic", "int8"),
    (torch.bfloat16, "stochastic", "bf16"),
    (torch.bfloat16, "stochastic", "fp32"),
    (torch.float16, True, "int8"),
    (torch.float16, "stochastic", "int8"),
    (torch.bfloat16, False, "bf16"),
]
OPTIMIZERS = {
    "adamw": lambda params, **kw: fusedamp.FusedAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "adamw_amsgrad": lambda params, **kw: fusedamp.FusedAdamW(params, lr=1e-2, amsgrad=True, **kw),
    "sgd": lambda params, **kw: fusedamp.FusedSGD(params, lr=1e-2, momentum=0.9, nesterov=True, **kw),
}


def make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=generator) * 0.5).to(dtype).requires_grad_() for n in SIZES]


def set_grads(params: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        grad = (
            torch.randn(param.shape, generator=generator)
            * 1e-2
            * 10 ** torch.randint(-3, 2, (1,), generator=generator).item()
        )
        param.grad = (grad * scale).to(param.dtype)


def run(optimizer: str, dtype: torch.dtype, master_weights, moments: str, steps: int = 4):
    params = make_params(dtype)
    opt = OPTIMIZERS[optimizer](params, master_weights=master_weights, moments=moments, seed=7)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return params, opt


def snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every param and state tensor, as raw bytes (so NaN payloads and -0 count)."""
    out = [p.detach().clone() for p in params]
    for param in params:
        for key in sorted(opt.state[param]):
            out.append(opt.state[param][key].clone())
    return [t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8) for t in out]


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("dtype", "master_weights", "moments"), MODES)
def test_every_isa_build_and_thread_count_gives_the_same_bits(
    optimizer, dtype, master_weights, moments
) -> None:
    previous_isa, previous_threads = _C.cpu_isa(), torch.get_num_threads()
    results = []
    try:
        for isa, threads in itertools.product(SUPPORTED_CPU_ISAS, (1, 2)):
            _C.set_cpu_isa(isa)
            torch.set_num_threads(threads)
            results.append(snapshot(*run(optimizer, dtype, master_weights, moments)))
    finally:
        _C.set_cpu_isa(previous_isa)
        torch.set_num_threads(previous_threads)
    for result in results[1:]:
        assert_bitwise(results[0], result)


def test_stochastic_rounding_of_non_finite_and_overflowing_values_is_the_same_on_every_isa_build() -> None:
    """The vector stochastic bf16 rounding (cpu/blocks.h) takes float_to_bf16's rounding for
    NaN and inf, and an update near bf16's largest value may round up to inf: every ISA build
    must store the bits of the element function (the baseline build), NaN payloads included."""
    values = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    values[::7] = float("nan")
    values[3::11] = float("inf")
    values[5::13] = -float("inf")
    values[1::17] = 3.38e38  # within a stochastic rounding of bf16's overflow to inf
    grads = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    grads[2::19] = float("nan")
    previous = _C.cpu_isa()
    results = []
    try:
        for isa in SUPPORTED_CPU_ISAS:
            _C.set_cpu_isa(isa)
            param = torch.nn.Parameter(values.to(torch.bfloat16))
            param.grad = grads.to(torch.bfloat16)
            opt = fusedamp.FusedAdamW([param], lr=0.5, master_weights="stochastic", seed=7)
            for _ in range(2):
                opt.step()
            results.append(param.detach().view(torch.int16).clone())
    finally:
        _C.set_cpu_isa(previous)
    for result in results[1:]:
        assert torch.equal(results[0], result)
    assert results[0].view(torch.bfloat16).isnan().any() and results[0].view(torch.bfloat16).isinf().any()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("dtype", "master_weights", "moments"), MODES)
def test_a_found_inf_step_changes_no_bit(optimizer, dtype, master_weights, moments) -> None:
    params, opt = run(optimizer, dtype, master_weights, moments, steps=2)
    before = snapshot(params, opt)
    set_grads(params, 5)
    opt.found_inf = torch.ones(())
    opt.grad_scale = torch.full((), 4.0)
    opt.step()
    assert_bitwise(before, snapshot(params, opt))


@pytest.mark.parametrize(("dtype", "master_weights", "moments"), MODES)
def test_inv_scale_and_clipping_are_applied_inside_the_step(dtype, master_weights, moments) -> None:
    # Grads scaled by 2^10 with the scale handed to the step and clipped inside it give the bits
    # of a plain step on fp32 grads that were multiplied by inv_scale * clip_coef beforehand.
    params, plain = make_params(dtype), make_params(dtype)
    opt = fusedamp.FusedAdamW(
        params, lr=1e-2, master_weights=master_weights, moments=moments, max_grad_norm=0.5
    )
    ref = fusedamp.FusedAdamW(plain, lr=1e-2, master_weights=master_weights, moments=moments)
    inv_scale = torch.full((), 1024.0).double().reciprocal().float()
    for p in plain:
        p.grad_dtype = None  # fp32 grads for half params
    for step in range(3):
        set_grads(params, step, scale=1024.0)
        opt.grad_scale = torch.full((), 1024.0)
        opt.found_inf = torch.zeros(())
        opt.step()
        coef = (0.5 / (opt.last_grad_norm + 1e-6)).clamp(max=1.0)
        set_grads(plain, step, scale=1024.0)
        for p in plain:
            p.grad = p.grad.float() * (inv_scale * coef)
        ref.step()
    assert_bitwise(snapshot(params, opt), snapshot(plain, ref))


@pytest.mark.parametrize("moments", ["int8", "bf16"])
def test_nan_grads_without_a_scaler_propagate_element_by_element(moments) -> None:
    param = torch.randn(600, requires_grad=True)
    reference = param.detach().clone().requires_grad_()
    opt = fusedamp.FusedAdamW([param], lr=1e-2, moments=moments)
    torch_opt = torch.optim.AdamW([reference], lr=1e-2)
    grad = torch.randn(600) * 1e-2
    grad[3] = float("nan")
    grad[300] = float("inf")
    param.grad, reference.grad = grad.clone(), grad.clone()
    opt.step()
    torch_opt.step()
    exported = opt.torch_state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        expected = torch_opt.state[reference][key]
        got = exported[key]
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
        assert got[expected.isfinite()].isfinite().all()
    assert torch.equal(param.isnan(), reference.isnan())


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("dtype", "master_weights", "moments"), MODES)
def test_native_state_dict_resumes_bitwise(optimizer, dtype, master_weights, moments) -> None:
    params, opt = run(optimizer, dtype, master_weights, moments, steps=3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = OPTIMIZERS[optimizer](resumed_params, master_weights=master_weights, moments=moments)
    resumed.load_state_dict(saved)  # the seed comes back with the param groups
    for step in range(3, 6):
        set_grads(params, step)
        set_grads(resumed_params, step)
        opt.step()
        resumed.step()
    assert_bitwise(snapshot(params, opt), snapshot(resumed_params, resumed))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("moments", ["int8", "bf16"])
def test_torch_state_dicts_load_quantized_and_export_back(optimizer, moments) -> None:
    params = make_params(torch.float32)
    torch_params = [p.detach().clone().requires_grad_() for p in params]
    torch_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    kwargs = {"lr": 1e-2} if optimizer == "adamw" else {"lr": 1e-2, "momentum": 0.9}
    torch_opt = torch_cls(torch_params, **kwargs)
    for step in range(2):
        set_grads(torch_params, step)
        torch_opt.step()
    fused_cls = fusedamp.FusedAdamW if optimizer == "adamw" else fusedamp.FusedSGD
    opt = fused_cls(params, moments=moments, **kwargs)
    opt.load_state_dict(torch_opt.state_dict())
    key = "exp_avg" if optimizer == "adamw" else "momentum_buffer"
    state = opt.state[params[3]]
    assert state[key].dtype == (torch.uint8 if moments == "int8" else torch.bfloat16)
    exported = opt.torch_state_dict()
    expected = torch_opt.state[torch_params[3]][key]
    if moments == "int8":  # the codec's nearest codes (tests/test_codec.py checks those)
        signed = key != "exp_avg_sq"
        nearest = ops.decode_state(*ops.encode_state(expected, signed), signed)
        torch.testing.assert_close(exported["state"][3][key], nearest)
        assert (exported["state"][3][key] - expected).norm() < 0.02 * expected.norm()
    else:
        torch.testing.assert_close(exported["state"][3][key], expected, rtol=2**-8, atol=0)
    # torch takes the export, and loading it back gives the identical codes.
    torch_cls([p.detach().clone() for p in params], **kwargs).load_state_dict(exported)
    again = fused_cls([p.detach().clone().requires_grad_() for p in params], moments=moments, **kwargs)
    again.load_state_dict(exported)
    for index in range(len(params)):
        for name, value in opt.state[params[index]].items():
            assert torch.equal(value, again.state[again.param_groups[0]["params"][index]][name])


def test_state_bytes_measure_the_state_tensors() -> None:
    params = [torch.zeros(1000, dtype=torch.bfloat16, requires_grad=True)]
    opt = fusedamp.FusedAdamW(params, master_weights="remainder", moments="int8")
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert opt.state_bytes() == {"masters": 2000, "moments": 2000, "scales": 2 * 4 * 2, "other": 4}


def test_stochastic_rounding_depends_on_the_seed_only_through_its_bits() -> None:
    first, _ = run("adamw", torch.bfloat16, "stochastic", "fp32")
    again, _ = run("adamw", torch.bfloat16, "stochastic", "fp32")
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    params = make_params(torch.bfloat16)
    opt = fusedamp.FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights="stochastic", seed=8)
    for step in range(4):
        set_grads(params, step)
        opt.step()
    assert not torch.equal(first[-1], params[-1])


def test_unsupported_combinations_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="Invalid moments value"):
        fusedamp.FusedAdamW([torch.zeros(3, requires_grad=True)], moments="int4")
    with pytest.raises(TypeError, match="float64.*moments='fp32'"):
        fusedamp.FusedAdamW([torch.zeros(3, dtype=torch.float64, requires_grad=True)], moments="int8")
    with pytest.raises(TypeError, match="complex64.*moments='fp32'"):
        fusedamp.FusedSGD([torch.zeros(3, dtype=torch.complex64, requires_grad=True)], moments="bf16")
    with pytest.raises(ValueError, match="'stochastic'"):
        fusedamp.FusedAdamW([torch.zeros(3, requires_grad=True)], master_weights="random")


def test_the_op_rejects_bad_scales_and_rounding_ids() -> None:
    param = torch.zeros(300)
    grad = torch.ones(300)
    codes = [torch.zeros(300, dtype=torch.uint8) for _ in range(2)]
    step = torch.zeros(())
    common = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(RuntimeError, match="exp_avg_scales\\[0\\] must be a contiguous tensor of 2 scales"):
        ops.adamw_(
            [param],
            [grad],
            [codes[0]],
            [codes[1]],
            [],
            [],
            [step],
            exp_avg_scales=[torch.zeros(1, dtype=torch.bfloat16)],
            exp_avg_sq_scales=[torch.zeros(2, dtype=torch.bfloat16)],
            **common,
        )
    with pytest.raises(TypeError, match="exp_avg_scales\\[0\\] is Float, expected bfloat16"):
        ops.adamw_(
            [param], [grad], [codes[0]], [codes[1]], [], [], [step],
            exp_avg_scales=[torch.zeros(2)],
            exp_avg_sq_scales=[torch.zeros(2, dtype=torch.bfloat16)],
            **common,
        )
    with pytest.raises(RuntimeError, match="exp_avg_scales has 0 tensors"):
        ops.adamw_([param], [grad], [codes[0]], [codes[1]], [], [], [step], **common)
    with pytest.raises(TypeError, match="stochastic_params is for float16 / bfloat16 params"):
        ops.adamw_(
            [param],
            [grad],
            [torch.zeros(300)],
            [torch.zeros(300)],
            [],
            [],
            [step],
            stochastic_params=True,
            **common,
        )
    with pytest.raises(RuntimeError, match="rounding_ids has 2 ids but params has 1"):
        ops.adamw_(
            [param],
            [grad],
            [torch.zeros(300)],
            [torch.zeros(300)],
            [],
            [],
            [step],
            rounding_ids=[0, 1],
            **common,
        )
    with pytest.raises(RuntimeError, match="scales go with uint8 states only"):
        ops.adamw_(
            [param],
            [grad],
            [torch.zeros(300)],
            [torch.zeros(300)],
            [],
            [],
            [step],
            exp_avg_scales=[torch.zeros(2)],
            **common,
        )
    assert param.eq(0).all() and step.eq(0)


@needs_cuda
@pytest.mark.parametrize("coded_runs", [1, 2])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("dtype", "master_weights", "moments"), MODES)
def test_cuda_gives_the_cpu_bits(optimizer, dtype, master_weights, moments, coded_runs) -> None:
    # Both backends compile without FMA contraction and share the codec and the hash: codes,
    # scales, params (stochastic ones included) and masters match bit for bit, in either layout
    # of the coded CUDA kernels (a codec block over two warps, or one warp's).
    cpu_params, cpu_opt = run(optimizer, dtype, master_weights, moments)
    params = [p.detach().cuda().requires_grad_() for p in make_params(dtype)]
    opt = OPTIMIZERS[optimizer](params, master_weights=master_weights, moments=moments, seed=7)
    previous = _C.set_cuda_launch_settings(coded_runs=coded_runs)
    try:
        for step in range(4):
            set_grads(cpu_params, step)  # the same grads, made on the CPU
            for param, cpu_param in zip(params, cpu_params, strict=True):
                param.grad = cpu_param.grad.cuda()
            opt.step()
    finally:
        _C.set_cuda_launch_settings(**previous)
    assert_bitwise(snapshot(cpu_params, cpu_opt), [t.cpu() for t in snapshot(params, opt)])


EARLIER_BUILD_CHECKPOINT = pathlib.Path(__file__).parent / "data" / "int8_state_earlier_build.pt"


def test_checkpoints_of_the_earlier_8_bit_format_load_converted_with_a_warning() -> None:
    """State saved by builds whose codes had 3 mantissa bits under float32 power-of-two scales
    (FusedAdamW with amsgrad and FusedSGD, int8 moments; with each its float32 export from that
    build): the codes decode exactly to that export, are encoded again to nearest, and a warning
    says so; the optimizer steps on."""
    saved = torch.load(EARLIER_BUILD_CHECKPOINT, weights_only=True)
    cases = [
        ("adamw", "params", lambda ps: fusedamp.FusedAdamW(ps, moments="int8", amsgrad=True)),
        ("sgd", "sgd_params", lambda ps: fusedamp.FusedSGD(ps, lr=1e-2, momentum=0.9, moments="int8")),
    ]
    for name, params_key, make in cases:
        params = [p.clone().requires_grad_() for p in saved[params_key]]
        opt = make(params)
        earlier_state = saved[f"{name}_state_dict"]["state"]
        with pytest.warns(UserWarning, match="earlier fusedamp build"):
            opt.load_state_dict(saved[f"{name}_state_dict"])
        exported = opt.torch_state_dict()["state"]
        for index, earlier_export in saved[f"{name}_torch_state_dict"]["state"].items():
            for key, values in earlier_export.items():
                if key == "step":
                    assert torch.equal(exported[index][key], values)
                    continue
                signed = key in _codecs.SIGNED_STATES
                codes, scales = earlier_state[index][key], earlier_state[index][key + "_scales"]
                assert torch.equal(_codecs.decode_earlier(codes, scales, signed), values)
                assert opt.state[params[index]][key + "_scales"].dtype == torch.bfloat16
                nearest = ops.decode_state(*ops.encode_state(values, signed), signed)
                assert torch.equal(exported[index][key], nearest), (name, index, key)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)
    # The DTensor form of that build: per-element uint8 scale exponents beside the codes.
    codes = saved["adamw_state_dict"]["state"][0]["exp_avg"]
    values = saved["adamw_torch_state_dict"]["state"][0]["exp_avg"]
    new_codes, new_scales = _dtensor_state.block_codes(codes, saved["exp_avg_element_exponents"], signed=True)
    assert new_scales.dtype == torch.bfloat16
    nearest = ops.decode_state(*ops.encode_state(values, True), True)
    assert torch.equal(ops.decode_state(new_codes, new_scales, True), nearest)

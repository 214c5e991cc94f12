"""FusedAdamW / FusedSGD against fp32 torch.optim.AdamW / SGD, precision-aware.

The reference runs torch's single-tensor optimizer on fp32 copies of the params, fed the same
grads (half grads widened exactly). fp32 params must match it within rel 1e-5; for half params
the fp32 master must, and the param must be the master rounded to its dtype (exactly with
fp32 masters, within one bf16 ulp with remainders, whose rounding differs on exact ties).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import needs_cuda
from torch import Tensor

import fusedamp
import fusedamp.optim._base
from fusedamp.optim import FusedAdamW, FusedSGD, join_bf16_remainder, split_bf16_remainder

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 22, 0, 65537]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

ADAMW_OPTIONS = {
    "default": {},
    "aggressive": {"lr": 1.0, "betas": (0.1, 0.25)},
    "amsgrad": {"lr": 1.0, "betas": (0.1, 0.25), "amsgrad": True},
    "maximize": {"lr": 0.1, "maximize": True, "weight_decay": 0.5},
    "no_decay": {"lr": 0.1, "weight_decay": 0.0, "eps": 1e-3},
}
SGD_OPTIONS = {
    "plain": {"lr": 0.1},
    "momentum": {"lr": 0.1, "momentum": 0.9},
    "dampening": {"lr": 0.5, "momentum": 0.5, "dampening": 0.3, "weight_decay": 0.1},
    "nesterov": {"lr": 1.0, "momentum": 0.9, "nesterov": True},
    "maximize": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.2, "maximize": True},
}
PAIRS = [
    pytest.param(FusedAdamW, torch.optim.AdamW, name, options, id=f"adamw-{name}")
    for name, options in ADAMW_OPTIONS.items()
] + [
    pytest.param(FusedSGD, torch.optim.SGD, name, options, id=f"sgd-{name}")
    for name, options in SGD_OPTIONS.items()
]


def random_tensors(sizes: list[int], dtype: torch.dtype, generator: torch.Generator) -> list[Tensor]:
    return [torch.randn(n, generator=generator).to(dtype) for n in sizes]


class Pair:
    """A fused optimizer and its fp32 torch reference, stepped with the same random grads."""

    def __init__(
        self,
        fused_cls: type,
        torch_cls: type,
        sizes: list[int],
        dtype: torch.dtype,
        options: dict[str, Any],
        seed: int = 0,
        **fused_options: Any,
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        initial = random_tensors(sizes, dtype, self.generator)
        self.params = [t.clone().requires_grad_() for t in initial]
        self.ref_params = [t.float().requires_grad_() for t in initial]
        self.fused = fused_cls(self.params, **options, **fused_options)
        self.ref = torch_cls(self.ref_params, **options, foreach=False)

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            for param, ref in zip(self.params, self.ref_params, strict=True):
                grad = torch.randn(param.shape, generator=self.generator).to(self.dtype)
                param.grad = grad
                ref.grad = grad.float()
            self.fused.step()
            self.ref.step()

    def check(self) -> None:
        for param, ref in zip(self.params, self.ref_params, strict=True):
            master = self.fused.master_of(param)
            torch.testing.assert_close(master, ref.detach(), **TOLERANCE)
            if param.dtype != torch.float32:
                assert_rounded_from(param, master, self.fused.param_groups[0]["master_weights"])


def assert_rounded_from(param: Tensor, master: Tensor, mode: Any) -> None:
    """The half param is its fp32 master rounded: exactly, or within one ulp for remainders."""
    expected = master.to(param.dtype)
    if mode == "remainder":
        ulps = (param.detach().view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        assert ulps.numel() == 0 or ulps.max().item() <= 1
        high, _ = split_bf16_remainder(master)
        assert torch.equal(param.detach().view(torch.int16), high.view(torch.int16))
    else:
        assert torch.equal(param.detach().view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), PAIRS)
def test_matches_fp32_torch_reference(fused_cls, torch_cls, name, options, dtype) -> None:
    pair = Pair(fused_cls, torch_cls, SIZES, dtype, options)
    pair.step(20)
    pair.check()
    for param in pair.params:
        assert pair.fused.state[param]["step"].item() == 20.0


@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), PAIRS)
def test_bf16_remainder_masters_equal_fp32_masters_bitwise(fused_cls, torch_cls, name, options) -> None:
    full = Pair(fused_cls, torch_cls, SIZES, torch.bfloat16, options)
    remainder = Pair(fused_cls, torch_cls, SIZES, torch.bfloat16, options, master_weights="remainder")
    full.step(20)
    remainder.step(20)
    remainder.check()
    for full_param, param in zip(full.params, remainder.params, strict=True):
        state = remainder.fused.state[param]
        assert "master" not in state and state["master_remainder"].dtype == torch.int16
        master = remainder.fused.master_of(param)
        assert torch.equal(master.view(torch.int32), full.fused.master_of(full_param).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), PAIRS)
def test_without_masters_half_params_take_each_update_rounded(fused_cls, torch_cls, name, options, dtype):
    pair = Pair(fused_cls, torch_cls, [22, 4099], dtype, options, master_weights=False)
    for _ in range(10):
        pair.step()
        for param, ref in zip(pair.params, pair.ref_params, strict=True):
            # The kernel widens the half param, updates it in fp32 and rounds back. fp32 updates
            # that differ in the last bits may round one ulp apart (more among subnormals):
            # resync so that such differences do not compound.
            expected = ref.detach().to(dtype).float()
            ulp = torch.finfo(dtype).eps
            torch.testing.assert_close(param.detach().float(), expected, rtol=ulp, atol=1e-5)
            ref.data.copy_(param.detach())
    assert all("master" not in pair.fused.state[param] for param in pair.params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masters_keep_updates_that_half_precision_loses(dtype: torch.dtype) -> None:
    # 1e-4 is below half an fp16/bf16 ulp at 1.0: each rounded step is lost, the master's are not.
    with_master = torch.ones(5, dtype=dtype, requires_grad=True)
    without = torch.ones(5, dtype=dtype, requires_grad=True)
    optimizers = [FusedSGD([with_master], lr=1e-4), FusedSGD([without], lr=1e-4, master_weights=False)]
    expected = torch.ones(5)
    for _ in range(40):
        with_master.grad = torch.ones(5, dtype=dtype)
        without.grad = torch.ones(5, dtype=dtype)
        for opt in optimizers:
            opt.step()
        expected -= 1e-4
    assert torch.equal(without.detach(), torch.ones(5, dtype=dtype))
    assert torch.equal(optimizers[0].master_of(with_master), expected)
    assert torch.equal(with_master.detach(), expected.to(dtype))
    assert with_master[0].item() < 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), [PAIRS[1], PAIRS[-2]])
def test_every_cpu_isa_matches_the_reference(cpu_isa, fused_cls, torch_cls, name, options, dtype) -> None:
    pair = Pair(fused_cls, torch_cls, SIZES, dtype, options)
    pair.step(20)
    pair.check()


@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), [PAIRS[2], PAIRS[-3]])
def test_a_thousand_tiny_tensors(fused_cls, torch_cls, name, options) -> None:
    sizes = torch.randint(0, 6, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    pair = Pair(fused_cls, torch_cls, sizes, torch.bfloat16, options)
    pair.step(5)
    pair.check()


def test_mixed_dtypes_in_one_optimizer_make_one_op_call_per_bucket(monkeypatch) -> None:
    calls = []
    real = fusedamp.optim._base.op_call

    def counting(op, lists, *args):
        call, dtypes = real(op, lists, *args), {p.dtype for p in lists[0]}

        def run(**kwargs):
            calls.append(dtypes)
            call(**kwargs)

        return run

    monkeypatch.setattr(fusedamp.optim._base, "op_call", counting)
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(n, generator=generator).to(d) for n in (5, 300) for d in DTYPES]
    params = [t.clone().requires_grad_() for t in initial]
    refs = [t.float().requires_grad_() for t in initial]
    fused = FusedAdamW(params, lr=1.0, betas=(0.1, 0.25))
    ref = torch.optim.AdamW(refs, lr=1.0, betas=(0.1, 0.25), foreach=False)
    for _ in range(10):
        for param, ref_param in zip(params, refs, strict=True):
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            ref_param.grad = param.grad.float()
        fused.step()
        ref.step()
    assert len(calls) == 10 * 3 and all(len(dtypes) == 1 for dtypes in calls)
    for param, ref_param in zip(params, refs, strict=True):
        torch.testing.assert_close(fused.master_of(param), ref_param.detach(), **TOLERANCE)
        assert fused.state[param]["exp_avg"].dtype == torch.float32


def test_param_groups_with_their_own_hyperparameters() -> None:
    generator = torch.Generator().manual_seed(3)
    initial = random_tensors([7, 22, 65, 1, 300], torch.float32, generator)
    params = [t.clone().requires_grad_() for t in initial]
    refs = [t.clone().requires_grad_() for t in initial]

    def groups(tensors: list[Tensor]) -> list[dict[str, Any]]:
        return [
            {"params": tensors[:2]},
            {"params": tensors[2:4], "lr": 1.0, "betas": (0.1, 0.25), "amsgrad": True},
            {"params": tensors[4:], "weight_decay": 0.3, "maximize": True, "eps": 1e-2},
        ]

    fused = FusedAdamW(groups(params), lr=0.01)
    ref = torch.optim.AdamW(groups(refs), lr=0.01, foreach=False)
    for _ in range(15):
        for param, ref_param in zip(params, refs, strict=True):
            param.grad = torch.randn(param.shape, generator=generator)
            ref_param.grad = param.grad.clone()
        fused.step()
        ref.step()
    for param, ref_param in zip(params, refs, strict=True):
        torch.testing.assert_close(param.detach(), ref_param.detach(), **TOLERANCE)
    assert "max_exp_avg_sq" in fused.state[params[2]] and "max_exp_avg_sq" not in fused.state[params[0]]


def test_params_without_grads_are_skipped() -> None:
    generator = torch.Generator().manual_seed(4)
    initial = random_tensors([9, 9, 9], torch.bfloat16, generator)
    params = [t.clone().requires_grad_() for t in initial]
    refs = [t.float().requires_grad_() for t in initial]
    fused = FusedSGD(params, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(refs, lr=0.1, momentum=0.9, foreach=False)
    for step in range(6):
        # params[0] always has a grad, params[1] every other step, params[2] never.
        for index in (0, 1) if step % 2 else (0,):
            grad = torch.randn(9, generator=generator).to(torch.bfloat16)
            params[index].grad, refs[index].grad = grad, grad.float()
        fused.step()
        ref.step()
        fused.zero_grad()
        ref.zero_grad()
    for param, ref_param in zip(params[:2], refs[:2], strict=True):
        torch.testing.assert_close(fused.master_of(param), ref_param.detach(), **TOLERANCE)
    assert fused.state[params[1]]["step"].item() == 3.0
    assert params[2] not in fused.state
    assert torch.equal(params[2].detach(), initial[2])


def test_tensor_lr_equals_float_lr_and_schedulers_drive_it() -> None:
    results = []
    for lr in (0.25, torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64)):
        generator = torch.Generator().manual_seed(5)
        param = torch.randn(100, generator=generator).requires_grad_()
        opt = FusedAdamW([param], lr=lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for _ in range(6):
            param.grad = torch.randn(100, generator=generator)
            opt.step()
            scheduler.step()
        results.append(param.detach())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize(
    ("fused_cls", "torch_cls", "options"),
    [(FusedAdamW, torch.optim.AdamW, {"lr": 0.1}), (FusedSGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})],
)
def test_lr_schedulers_match_torch(fused_cls, torch_cls, options) -> None:
    pair = Pair(fused_cls, torch_cls, [7, 300], torch.float16, options)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3) for opt in (pair.fused, pair.ref)
    ]
    for _ in range(10):
        pair.step()
        for scheduler in schedulers:
            scheduler.step()
    assert pair.fused.param_groups[0]["lr"] == pytest.approx(0.1 * 0.3**3)
    pair.check()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none: bool) -> None:
    param = torch.randn(4, requires_grad=True)
    param.grad = torch.randn(4)
    opt = FusedSGD([param])
    opt.zero_grad(set_to_none=set_to_none)
    assert param.grad is None if set_to_none else torch.equal(param.grad, torch.zeros(4))


NAN_BITS = [0x7FFF8000, 0x7FFFFFFF, 0x7FC00000, 0x7F800001, -0x00008000, -0x00000001, -0x00400000]


def test_split_bf16_remainder_keeps_nan_a_nan() -> None:
    """NaN masters whose bits + 0x8000 wrap (0x7FFF8000.., 0xFFFF8000..) once became signed zeros."""
    masters = torch.tensor(NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    param, remainder = split_bf16_remainder(masters)
    assert param.float().isnan().all()
    assert join_bf16_remainder(param, remainder).isnan().all()


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_remainder_step_with_a_nan_state_writes_a_nan_param(cls) -> None:
    """A NaN update in remainder mode (here from a NaN moment, as a checkpoint could hold) must
    leave a NaN weight, not a zero that hides the divergence. The GPU's canonical NaN is
    0x7FFFFFFF, one of the patterns that wrapped. Five copies of the patterns (35 values) reach
    the vector lanes of the staged CPU kernels as well as their scalar tails."""
    copies = 5
    param = torch.ones(len(NAN_BITS) * copies, dtype=torch.bfloat16, requires_grad=True)
    param.grad = torch.ones_like(param)
    opt = cls([param], lr=0.1, momentum=0.9) if cls is FusedSGD else cls([param], lr=0.1)
    opt.step()
    moment = "momentum_buffer" if cls is FusedSGD else "exp_avg"
    nan_bits = torch.tensor(NAN_BITS * copies, dtype=torch.int64).to(torch.int32)
    opt.state[param][moment].view(torch.int32).copy_(nan_bits)
    opt.step()
    assert param.detach().float().isnan().all()
    assert opt.master_of(param).isnan().all()


def test_split_and_join_bf16_remainder_round_trip_every_pattern_class() -> None:
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(6))
    special = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, -0x00008000, 0x00000001, 0x7F800000])
    masters = torch.cat([bits, special]).to(torch.int32).view(torch.float32)
    masters = masters[masters.isfinite()]
    param, remainder = split_bf16_remainder(masters)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_bf16_remainder(param, remainder).view(torch.int32), masters.view(torch.int32))
    ulps = (param.view(torch.int16).int() - masters.to(torch.bfloat16).view(torch.int16).int()).abs()
    assert ulps.max().item() == 1  # the exact ties 0x3F808000 / 0x3F818000 round differently
    assert (ulps == 0).float().mean().item() > 0.999


# --- bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (FusedAdamW, {"lr": -1.0}, "Invalid learning rate: -1.0"),
        (FusedAdamW, {"eps": -1e-8}, "Invalid epsilon value: -1e-08"),
        (FusedAdamW, {"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
        (FusedAdamW, {"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
        (FusedAdamW, {"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
        (FusedAdamW, {"lr": torch.ones(2)}, "Tensor lr must be 1-element"),
        (FusedAdamW, {"max_grad_norm": 0.0}, "Invalid max_grad_norm value: 0.0"),
        (FusedAdamW, {"master_weights": "fp8"}, "Invalid master_weights value: 'fp8'"),
        (FusedSGD, {"lr": -1.0}, "Invalid learning rate: -1.0"),
        (FusedSGD, {"momentum": -0.5}, "Invalid momentum value: -0.5"),
        (FusedSGD, {"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
        (FusedSGD, {"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
        (FusedSGD, {"momentum": 0.9, "dampening": 0.1, "nesterov": True}, "Nesterov momentum requires"),
    ],
)
def test_invalid_hyperparameters_raise_torchs_errors(cls, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls([torch.zeros(2, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_remainder_masters_need_bf16_params(cls) -> None:
    params = [torch.zeros(2, dtype=dtype, requires_grad=True) for dtype in (torch.bfloat16, torch.float16)]
    message = "master_weights='remainder' needs bfloat16 params; param 1 of group 0 is float16"
    with pytest.raises(ValueError, match=message):
        cls(params, master_weights="remainder")


@pytest.mark.parametrize("cls", [FusedAdamW])  # FusedSGD takes them: tests/test_dropin_edges.py
def test_sparse_grads_raise(cls) -> None:
    param = torch.zeros(3, requires_grad=True)
    param.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        cls([param]).step()


def test_step_returns_the_closure_loss() -> None:
    param = torch.ones(3, requires_grad=True)
    opt = FusedSGD([param], lr=0.5)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = (param * param).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.equal(param.detach(), torch.zeros(3))


# --- CUDA (runs on a GPU machine) ------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(
    ("dtype", "master_weights"),
    [(dtype, mode) for dtype in DTYPES for mode in (True, False)] + [(torch.bfloat16, "remainder")],
)
@pytest.mark.parametrize(("fused_cls", "torch_cls", "name", "options"), [PAIRS[2], PAIRS[-2]])
def test_cuda_matches_cpu(fused_cls, torch_cls, name, options, dtype, master_weights) -> None:
    generator = torch.Generator().manual_seed(7)
    initial = random_tensors(SIZES + [1 << 20], dtype, generator)
    runs = {}
    for device in ("cpu", "cuda"):
        params = [t.clone().to(device).requires_grad_() for t in initial]
        opt = fused_cls(params, **options, master_weights=master_weights)
        grads = torch.Generator().manual_seed(8)
        for _ in range(20):
            for param in params:
                param.grad = torch.randn(param.shape, generator=grads).to(dtype).to(device)
            opt.step()
        runs[device] = (params, opt)
    for cpu_param, cuda_param in zip(runs["cpu"][0], runs["cuda"][0], strict=True):
        cuda_master = runs["cuda"][1].master_of(cuda_param).cpu()
        torch.testing.assert_close(cuda_master, runs["cpu"][1].master_of(cpu_param), rtol=1e-6, atol=1e-6)
        if dtype != torch.float32 and master_weights:
            assert_rounded_from(cuda_param.cpu(), cuda_master, master_weights)
        assert runs["cuda"][1].state[cuda_param]["step"].device.type == "cuda"


@needs_cuda
def test_cpu_and_cuda_params_in_one_optimizer() -> None:
    generator = torch.Generator().manual_seed(9)
    initial = random_tensors([7, 300], torch.bfloat16, generator)
    params = [initial[0].clone().requires_grad_(), initial[1].cuda().requires_grad_()]
    refs = [t.float().requires_grad_() for t in initial]
    fused = FusedAdamW(params, lr=1.0, betas=(0.1, 0.25), max_grad_norm=1.0)
    ref = torch.optim.AdamW(refs, lr=1.0, betas=(0.1, 0.25), foreach=False)
    for _ in range(5):
        for param, ref_param in zip(params, refs, strict=True):
            grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
            param.grad, ref_param.grad = grad.to(param.device), grad.float()
        fused.step()
        torch.nn.utils.clip_grad_norm_(refs, 1.0)
        ref.step()
    for param, ref_param in zip(params, refs, strict=True):
        torch.testing.assert_close(fused.master_of(param).cpu(), ref_param.detach(), **TOLERANCE)
    assert fused.last_grad_norm.device.type == "cpu"


@pytest.fixture
def restore_prefetch() -> Any:
    before = fusedamp._C.cpu_prefetch_blocks()
    yield
    fusedamp._C.set_cpu_prefetch_blocks(before)


def test_prefetch_distance_is_chosen_per_cpu_vendor(restore_prefetch: Any) -> None:
    import os
    import platform

    if os.environ.get("FUSEDAMP_CPU_PREFETCH"):
        expected = int(os.environ["FUSEDAMP_CPU_PREFETCH"])
    elif platform.machine() in ("x86_64", "AMD64"):
        with open("/proc/cpuinfo") as cpuinfo:
            expected = 0 if "AuthenticAMD" in cpuinfo.read() else 2
    else:
        expected = 2
    assert fusedamp._C.cpu_prefetch_blocks() == expected
    assert fusedamp._C.set_cpu_prefetch_blocks(5) == expected and fusedamp._C.cpu_prefetch_blocks() == 5
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="prefetch distance must be 0 to 8 codec blocks"):
            fusedamp._C.set_cpu_prefetch_blocks(bad)


@pytest.mark.parametrize(
    ("dtype", "options"),
    [(torch.float32, {}), (torch.float32, {"moments": "int8"}),
     (torch.bfloat16, {"master_weights": "remainder", "moments": "int8", "max_grad_norm": 1.0}),
     (torch.bfloat16, {"master_weights": "stochastic", "moments": "bf16"})],
)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_prefetch_distance_changes_no_bits(
    kind: str, dtype: torch.dtype, options: dict[str, Any], restore_prefetch: Any
) -> None:
    """Prefetching is a hint: every distance (none, the defaults, the farthest) gives the same
    params and state, on tensors of many codec blocks and a ragged tail."""
    generator = torch.Generator().manual_seed(11)
    initial = random_tensors([5000, 70_001, 3], dtype, generator)
    grads = [torch.randn(t.shape, generator=generator).to(dtype) for t in initial]
    runs = []
    for blocks in (0, 1, 2, 8):
        fusedamp._C.set_cpu_prefetch_blocks(blocks)
        params = [t.clone().requires_grad_() for t in initial]
        if kind == "adamw":
            opt = FusedAdamW(params, lr=1e-2, **options)
        else:
            opt = FusedSGD(params, lr=1e-2, momentum=0.9, **options)
        for _ in range(3):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.clone()
            opt.step()
        runs.append(([p.detach() for p in params], opt.state_dict()))
    for params, state in runs[1:]:
        for mine, first in zip(params, runs[0][0], strict=True):
            assert torch.equal(mine, first)
        for key, value in state["state"].items():
            for name, tensor in value.items():
                if isinstance(tensor, Tensor):
                    assert torch.equal(tensor, runs[0][1]["state"][key][name]), (key, name)


def test_prefetch_distance_changes_no_unscaled_bits(restore_prefetch: Any) -> None:
    generator = torch.Generator().manual_seed(12)
    grads = [torch.randn(n, generator=generator).to(torch.bfloat16) for n in (70_001, 300)]
    results = []
    for blocks in (0, 2, 8):
        fusedamp._C.set_cpu_prefetch_blocks(blocks)
        mine, found_inf = [g.clone() for g in grads], torch.zeros(())
        fusedamp.ops.unscale_(mine, found_inf, torch.tensor(0.125))
        results.append((mine, found_inf.item()))
    for mine, found in results[1:]:
        assert found == results[0][1] == 0.0
        assert all(torch.equal(a, b) for a, b in zip(mine, results[0][0], strict=True))

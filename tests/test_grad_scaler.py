"""fusedamp.GradScaler side by side with torch.amp.GradScaler, and what it does beyond it."""

from __future__ import annotations

import copy
import math
import pickle
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import needs_cuda
from torch import nn

from fusedamp import ops
from fusedamp.grad_scaler import GradScaler

NON_FINITE = (math.inf, -math.inf, math.nan)


class ProtocolSGD(torch.optim.Optimizer):
    """Plain SGD that follows the fused-optimizer protocol: it unscales by ``grad_scale`` and
    skips on ``found_inf > 0`` on the device, with no host sync."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    @torch.no_grad()
    def step(self) -> str:
        self.seen.append((self.grad_scale, self.found_inf))
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.float()
                if self.grad_scale is not None:
                    grad = grad * self.grad_scale.double().reciprocal().float()
                update = torch.where(self.found_inf > 0, 0.0, group["lr"] * grad)
                param.sub_(update.to(param.dtype))
        return "stepped"


class ProtocolSGDWithCheck(ProtocolSGD):
    """ProtocolSGD that also does the read-only grad check itself, as fusedamp's optimizers do
    (their single pass also takes the norm for fused clipping)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr)
        self.check_calls: list[torch.Tensor] = []

    def _fusedamp_check_grads(self, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        self.check_calls.append(inv_scale)
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        found_inf = torch.zeros((), device=inv_scale.device)
        self.grad_norm_squared = torch.zeros((), device=inv_scale.device)
        ops.check_and_norm_(grads, found_inf, self.grad_norm_squared, inv_scale)
        return {inv_scale.device: found_inf}


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7)).to(device, dtype)


def batch(
    step: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=generator)
    y = torch.randn(8, 7, generator=generator)
    return x.to(device, dtype), y.to(device, dtype)


def scaled_backward(model: nn.Module, scaler, step: int, autocast_dtype: torch.dtype | None = None) -> None:
    param = next(model.parameters())
    x, y = batch(step, param.dtype, param.device.type)
    with torch.autocast(param.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = (model(x).float() - y.float()).square().mean()
    scaler.scale(loss).backward()


def inject_non_finite(model: nn.Module, step: int) -> None:
    """Puts inf, -inf or NaN (by step) into one element of one gradient (by step)."""
    params = list(model.parameters())
    grad = params[step % len(params)].grad.view(-1)
    grad[(step * 7919) % grad.numel()] = NON_FINITE[step % 3]


def clone_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


OPTIMIZERS: dict[str, Callable] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "unscale_clip"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_matches_torch(optimizer: str, clip: bool) -> None:
    """50 bf16-autocast steps with overflows injected at 12 of them: same scales, same skipped
    steps, bitwise the same weights. Bitwise, because both unscale with one fp32 multiply by
    the same inverse scale (taken in float64, rounded once) and then run the same optimizer."""
    ours_model = make_model()
    torch_model = copy.deepcopy(ours_model)
    ours_opt = OPTIMIZERS[optimizer](ours_model.parameters())
    torch_opt = OPTIMIZERS[optimizer](torch_model.parameters())
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    overflow_steps = {2, 3, 4, 9, 15, 16, 22, 30, 31, 32, 40, 47}
    skipped = torch.zeros((), dtype=torch.int64)
    for step in range(50):
        for model, opt, scaler in ((ours_model, ours_opt, ours), (torch_model, torch_opt, theirs)):
            opt.zero_grad()
            scaled_backward(model, scaler, step, torch.bfloat16)
            if step in overflow_steps:
                inject_non_finite(model, step)
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            scaler.step(opt)
        assert bool(ours.step_skipped) == (step in overflow_steps)
        skipped += ours.step_skipped
        ours.update()
        theirs.update()
        assert bool(ours.step_skipped) == (step in overflow_steps)
        assert ours.get_scale() == theirs.get_scale()
        assert_same_params(ours_model, torch_model)
    assert skipped.item() == len(overflow_steps)
    assert ours.state_dict() == theirs.state_dict()
    for ours_state, torch_state in zip(ours_opt.state.values(), torch_opt.state.values(), strict=True):
        for key, value in ours_state.items():
            assert torch.equal(value, torch_state[key]), key


def test_two_optimizers_match_torch() -> None:
    """Each optimizer skips on its own grads; the scale backs off if either overflowed."""
    models = [make_model(1), make_model(2)]
    torch_models = copy.deepcopy(models)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    torch_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in torch_models]
    ours = GradScaler("cpu", growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", growth_interval=2)
    for step in range(8):
        for scaler, ms, os_ in ((ours, models, opts), (theirs, torch_models, torch_opts)):
            for index, (model, opt) in enumerate(zip(ms, os_, strict=True)):
                opt.zero_grad()
                scaled_backward(model, scaler, step)
                if step % 4 == index + 1:
                    inject_non_finite(model, step)
                scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale()
        assert bool(ours.step_skipped) == (step % 4 in (1, 2))
        for ours_model, torch_model in zip(models, torch_models, strict=True):
            assert_same_params(ours_model, torch_model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, ProtocolSGD, ProtocolSGDWithCheck])
def test_half_gradients_are_unscaled(dtype: torch.dtype, optimizer: type) -> None:
    """fp16 and bf16 grads (torch refuses fp16): each grad becomes grad * (1 / scale) rounded
    to its dtype, and the step sees exactly that."""
    model = make_model(dtype=dtype)
    reference_model = copy.deepcopy(model)
    scaler = GradScaler("cpu", init_scale=3000.0)  # not a power of two: the product rounds
    opt = optimizer(model.parameters(), lr=0.1)
    scaled_backward(model, scaler, step=0)
    inv_scale = torch.tensor(1 / 3000.0, dtype=torch.float64).float()
    expected_grads = [(g.float() * inv_scale).to(dtype) for g in clone_grads(model)]
    scaler.step(opt)
    for param, grad in zip(reference_model.parameters(), expected_grads, strict=True):
        param.grad = grad
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    reference_opt.step()
    if optimizer is torch.optim.SGD:
        assert_same_params(model, reference_model)
    else:
        # ProtocolSGD unscales in fp32 without rounding the grad to its dtype first.
        for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=2 * torch.finfo(dtype).eps)

    if dtype == torch.float16 and optimizer is torch.optim.SGD:
        torch_scaler = torch.amp.GradScaler("cpu")
        scaled_backward(model, torch_scaler, step=1)
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            torch_scaler.step(opt)


def test_mixed_gradient_dtypes_in_one_optimizer() -> None:
    layers = [nn.Linear(5, 5).to(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    scaler = GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    x = torch.randn(3, 5)
    loss = sum(layer(x.to(layer.weight.dtype)).float().sum() for layer in layers)
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in opt.param_groups[0]["params"]]
    scaler.unscale_(opt)
    for grad, before in zip((p.grad for p in opt.param_groups[0]["params"]), scaled, strict=True):
        assert torch.equal(grad, (before.float() / 1024.0).to(before.dtype))
    assert not scaler.step_skipped


def test_fused_optimizer_with_own_check() -> None:
    """READY stage: the optimizer's one read-only pass is used, the grads are left scaled, and
    the optimizer gets the scale and found_inf for the duration of its step."""
    model = make_model()
    opt = ProtocolSGDWithCheck(model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**12)
    for step in range(3):
        opt.zero_grad()
        scaled_backward(model, scaler, step)
        if step == 1:
            inject_non_finite(model, step)
        scaled = clone_grads(model)
        inv_scale = 1.0 / scaler.get_scale()  # 2^-12, then 2^-11 after the overflow
        assert scaler.step(opt) == "stepped"
        assert len(opt.check_calls) == step + 1
        assert opt.check_calls[-1].item() == inv_scale
        grad_scale, found_inf = opt.seen[-1]
        assert grad_scale is scaler._scale
        assert found_inf.item() == float(step == 1)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        for grad, before in zip(clone_grads(model), scaled, strict=True):
            assert torch.equal(grad, before)
        scaler.update()
    expected_norm = sum((g.double() * inv_scale).square().sum() for g in scaled)
    assert opt.grad_norm_squared.item() == pytest.approx(expected_norm.item(), rel=1e-5)


@pytest.mark.parametrize("optimizer", ["protocol", "adamw_fused"])
def test_fused_optimizer_without_own_check_reads_grads_only(optimizer: str) -> None:
    model = make_model()
    if optimizer == "protocol":
        opt = ProtocolSGD(model.parameters())
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True)
    seen_by_step: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda *_: seen_by_step.append(clone_grads(model)))
    scaler = GradScaler("cpu")
    scaled_backward(model, scaler, step=0)
    scaled = clone_grads(model)
    scaler.step(opt)
    for grad, before in zip(seen_by_step[0], scaled, strict=True):
        assert torch.equal(grad, before)
    assert not scaler.step_skipped


@pytest.mark.parametrize("optimizer", [ProtocolSGD, ProtocolSGDWithCheck])
def test_unscale_clip_step_unscales_once(optimizer: type) -> None:
    """With a power-of-two scale, scaling is exact: the scaled run equals the unscaled one bitwise."""
    model = make_model()
    reference = copy.deepcopy(model)
    opt = optimizer(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**14)
    for step in range(3):
        opt.zero_grad()
        scaled_backward(model, scaler, step)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3)
        scaler.step(opt)
        scaler.update()
        assert opt.seen[-1][0] is None
        reference.zero_grad()
        x, y = batch(step)
        (reference(x) - y).square().mean().backward()
        nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.3)
        with torch.no_grad():
            for param in reference.parameters():
                param.sub_(0.1 * param.grad)
        assert_same_params(model, reference)
    if optimizer is ProtocolSGDWithCheck:
        assert opt.check_calls == []


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def scaler_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every host sync the scaler's own code makes (calls made from grad_scaler.py)."""
    calls: list[str] = []

    def recording(name: str, original: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("fusedamp/grad_scaler.py"):
                calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
    yield calls


@pytest.mark.parametrize("optimizer", [ProtocolSGD, ProtocolSGDWithCheck, "adamw_fused"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_path_has_no_host_sync(scaler_syncs: list[str], optimizer, unscale_first: bool) -> None:
    model = make_model()
    if optimizer == "adamw_fused":
        opt = torch.optim.AdamW(model.parameters(), fused=True)
    else:
        opt = optimizer(model.parameters())
    scaler = GradScaler("cpu", growth_interval=2)
    skipped = torch.zeros((), dtype=torch.int64)
    for step in range(4):
        opt.zero_grad()
        scaled_backward(model, scaler, step)
        if step == 2:
            inject_non_finite(model, step)
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        skipped += scaler.step_skipped
        scaler.update()
    assert scaler_syncs == []
    assert skipped.item() == 1


def test_plain_optimizer_syncs_once_per_step(scaler_syncs: list[str]) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    for step in range(3):
        opt.zero_grad()
        scaled_backward(model, scaler, step)
        scaler.step(opt)
        scaler.update()
    assert scaler_syncs == ["__bool__"] * 3


def train_five_steps(compiled: bool) -> tuple[nn.Module, list[float]]:
    torch._dynamo.reset()
    model = make_model()
    opt = ProtocolSGDWithCheck(model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=2)

    def scaled_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - y).square().mean()
        return scaler.scale(loss)

    def step_and_update() -> None:
        scaler.step(opt)
        scaler.update()

    if compiled:
        scaled_loss = torch.compile(scaled_loss, backend="aot_eager", fullgraph=True)
        step_and_update = torch.compile(step_and_update, backend="aot_eager", fullgraph=True)
    scales = []
    for step in range(5):
        opt.zero_grad()
        scaled_loss(*batch(step)).backward()
        if step == 3:
            inject_non_finite(model, step)
        step_and_update()
        scales.append(scaler.get_scale())
    return model, scales


def test_fused_step_under_torch_compile_has_no_graph_break() -> None:
    """scale() inside a compiled forward and step() + update() on a fused optimizer compile to
    single graphs (fullgraph=True fails on any break), and compute what eager mode does."""
    eager_model, eager_scales = train_five_steps(compiled=False)
    compiled_model, compiled_scales = train_five_steps(compiled=True)
    assert compiled_scales == eager_scales == [256.0, 512.0, 512.0, 256.0, 256.0]
    assert_same_params(compiled_model, eager_model)


def test_strided_and_channels_last_grads() -> None:
    """Kernels read memory linearly: a channels_last grad is unscaled through a view of its
    memory, a grad with gaps through a contiguous copy written back."""
    conv = nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    holder = nn.Parameter(torch.randn(6, 4))
    scaler = GradScaler("cpu", init_scale=512.0)
    opt = torch.optim.SGD([*conv.parameters(), holder], lr=0.1)
    out = conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last))
    scaler.scale(out.square().mean()).backward()
    holder.grad = torch.randn(6, 8)[:, ::2]
    holder.grad[1, 1] = math.inf
    assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last)
    scaled = [p.grad.clone() for p in opt.param_groups[0]["params"]]
    scaler.unscale_(opt)
    for param, before in zip(opt.param_groups[0]["params"], scaled, strict=True):
        torch.testing.assert_close(param.grad, before / 512.0, rtol=0, atol=0)
    assert scaler.step_skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sparse_grads(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True).to(dtype)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0)
    indices = torch.tensor([1, 3, 3, 7])
    scaler.scale(embedding(indices).float().sum()).backward()
    expected = embedding.weight.grad.coalesce().to_dense() / 4.0
    scaler.unscale_(opt)
    torch.testing.assert_close(embedding.weight.grad.to_dense(), expected, rtol=0, atol=0)
    # fp16 sparse grads are coalesced first: duplicate indices could overflow once summed.
    assert embedding.weight.grad.is_coalesced() == (dtype == torch.float16)
    assert not scaler.step_skipped


def misuse_cases() -> dict[str, Callable]:
    """Each function takes a scaler class and misuses an instance of it."""

    def ready(scaler_cls, **kwargs):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = scaler_cls("cpu", **kwargs)
        scaled_backward(model, scaler, step=0)
        return scaler, opt

    def unscale_twice(cls):
        scaler, opt = ready(cls)
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    def unscale_after_step(cls):
        scaler, opt = ready(cls)
        scaler.step(opt)
        scaler.unscale_(opt)

    def step_twice(cls):
        scaler, opt = ready(cls)
        scaler.step(opt)
        scaler.step(opt)

    def closure(cls):
        scaler, opt = ready(cls)
        scaler.step(opt, closure=lambda: 0.0)

    def no_grads(cls):
        scaler, _ = ready(cls)
        scaler.step(torch.optim.SGD(make_model().parameters(), lr=0.1))

    def update_without_step(cls):
        scaler, _ = ready(cls)
        scaler.update()

    def bad_new_scale(cls):
        scaler, opt = ready(cls)
        scaler.step(opt)
        scaler.update(torch.ones(2))

    def pickle_mid_iteration(cls):
        scaler, opt = ready(cls)
        scaler.step(opt)
        pickle.dumps(scaler)

    cases = {
        "unscale_twice": unscale_twice,
        "unscale_after_step": unscale_after_step,
        "step_twice": step_twice,
        "closure": closure,
        "no_grads": no_grads,
        "update_without_step": update_without_step,
        "bad_new_scale": bad_new_scale,
        "pickle_mid_iteration": pickle_mid_iteration,
        "scale_as_int": lambda cls: cls("cpu").scale(3),
        "growth_factor": lambda cls: cls("cpu", growth_factor=1.0),
        "backoff_factor": lambda cls: cls("cpu", backoff_factor=1.0),
        "empty_state_dict": lambda cls: cls("cpu").load_state_dict({}),
    }
    for method in ("unscale_", "step", "update"):

        def before_scale(cls, method=method):
            args = [] if method == "update" else [torch.optim.SGD(make_model().parameters(), lr=0.1)]
            getattr(cls("cpu"), method)(*args)

        cases[f"{method}_before_scale"] = before_scale
    return cases


@pytest.mark.parametrize("case", misuse_cases().items(), ids=misuse_cases().keys())
def test_misuse_raises_like_torch(case: tuple[str, Callable]) -> None:
    _, misuse = case
    errors = []
    for scaler_cls in (GradScaler, torch.amp.GradScaler):
        with pytest.raises(Exception) as error:
            misuse(scaler_cls)
        errors.append((error.type, str(error.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"growth_interval": 0}, "growth_interval must be a positive int, got 0"),
        ({"hysteresis": 0}, "hysteresis must be a positive int, got 0"),
        ({"min_scale": -1.0}, "need 0 <= min_scale <= max_scale, got -1.0 and inf"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "need 0 <= min_scale <= max_scale, got 8.0 and 4.0"),
    ],
)
def test_bad_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradScaler("cpu", **kwargs)


def run_steps(scaler, model: nn.Module, opt, steps: range, overflow_steps: set[int]) -> None:
    for step in steps:
        opt.zero_grad()
        scaled_backward(model, scaler, step)
        if step in overflow_steps:
            inject_non_finite(model, step)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize(
    "options",
    [{}, {"hysteresis": 2, "min_scale": 64.0, "max_scale": 2.0**20}],
    ids=["torch_options", "fusedamp_options"],
)
def test_state_dict_and_pickle_round_trip(options: dict) -> None:
    overflow_steps = {1, 2, 4}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=256.0, growth_interval=3, **options)
    run_steps(scaler, model, opt, range(6), overflow_steps)
    state = scaler.state_dict()
    extra_keys = {"hysteresis", "_hysteresis_tracker", "min_scale", "max_scale"}
    torch_keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert set(state) == torch_keys | (extra_keys if options else set())
    restored = GradScaler("cpu")
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    unpickled = pickle.loads(pickle.dumps(scaler))
    assert unpickled.state_dict() == state

    # All three continue identically, including the hysteresis countdown and bounds.
    continued = []
    for copy_of_scaler in (scaler, restored, unpickled):
        continued_model = copy.deepcopy(model)
        continued_opt = torch.optim.SGD(continued_model.parameters(), lr=0.1)
        run_steps(copy_of_scaler, continued_model, continued_opt, range(6, 14), {7, 8, 11})
        continued.append(copy_of_scaler.state_dict())
    assert continued[0] == continued[1] == continued[2]


def test_state_dict_interchange_with_torch() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=2)
    run_steps(theirs, model, opt, range(5), {1})
    ours = GradScaler("cpu", hysteresis=3, max_scale=10.0)
    ours.load_state_dict(theirs.state_dict())  # absent options: the defaults it was saved with
    assert ours.state_dict() == theirs.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == theirs.state_dict()


def test_hysteresis_min_and_max_scale() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(
        "cpu", init_scale=1024.0, growth_interval=1, hysteresis=2, min_scale=300.0, max_scale=2048.0
    )
    expected = {
        # step: (overflow, scale after update)
        0: (False, 2048.0),
        1: (False, 2048.0),  # max_scale
        2: (True, 2048.0),  # the first overflow is tolerated
        3: (True, 1024.0),
        4: (True, 512.0),
        5: (True, 300.0),  # min_scale
        6: (False, 600.0),  # growth refills the hysteresis
        7: (True, 600.0),
    }
    for step, (overflow, scale) in expected.items():
        run_steps(scaler, model, opt, range(step, step + 1), {step} if overflow else set())
        assert scaler.get_scale() == scale
        assert bool(scaler.step_skipped) == overflow


def test_update_with_new_scale() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    run_steps(scaler, model, opt, range(1), set())
    scaler.update(100.0)
    assert scaler.get_scale() == 100.0
    scaler.update(torch.tensor(50.0))
    assert scaler.get_scale() == 50.0


def test_step_skipped_lifetime() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaled_backward(model, scaler, step=0)
    with pytest.raises(RuntimeError, match="step_skipped is known once step"):
        _ = scaler.step_skipped
    inject_non_finite(model, step=0)
    scaler.unscale_(opt)
    assert scaler.step_skipped.dtype == torch.bool and scaler.step_skipped.shape == ()
    assert scaler.step_skipped
    scaler.step(opt)
    scaler.update()
    assert scaler.step_skipped  # still the finished iteration
    opt.zero_grad()
    scaled_backward(model, scaler, step=1)
    assert scaler.step_skipped  # the new iteration has not checked its grads yet
    scaler.step(opt)
    assert not scaler.step_skipped


def test_scale_nested_outputs() -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    a, b, c = torch.randn(3), torch.randn(2), torch.randn(1)
    scaled = scaler.scale([a, (b, [c])])
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple)
    assert torch.equal(scaled[0], a * 4) and torch.equal(scaled[1][0], b * 4)
    assert torch.equal(scaled[1][1][0], c * 4)
    lazily_scaled = scaler.scale(iter([a, b]))
    assert not isinstance(lazily_scaled, (list, tuple))
    assert [torch.equal(s, t * 4) for s, t in zip(lazily_scaled, [a, b], strict=True)] == [True, True]


def test_disabled_is_a_passthrough() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(batch(0)[0]).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    inject_non_finite(model, step=1)  # a disabled scaler does not look
    grads = clone_grads(model)
    scaler.unscale_(opt)
    assert scaler.step(opt) is None
    scaler.update()
    assert all(torch.equal(g, h) for g, h in zip(clone_grads(model), grads, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True))
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    assert not scaler.step_skipped
    scaler.load_state_dict({})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_cuda_without_gpu_warns_and_disables() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling."):
        scaler = GradScaler()
    assert not scaler.is_enabled()


def test_getters_and_setters() -> None:
    scaler = GradScaler("cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (8.0, 3.0, 0.25)
    assert scaler.get_growth_interval() == 7 and scaler.is_enabled()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_steps(scaler, model, opt, range(1), set())
    assert scaler.get_scale() == 32.0
    run_steps(scaler, model, opt, range(1, 2), {1})
    assert scaler.get_scale() == 4.0


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_training_matches_torch_without_sync(dtype: torch.dtype) -> None:
    """On a GPU: fp16/bf16 autocast with torch's fused AdamW, the same as torch's scaler, and
    no host sync anywhere in scale/step/update (torch's sync debug mode raises on one)."""
    ours_model = make_model(device="cuda")
    torch_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2, fused=True)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, fused=True)
    ours = GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    for step in range(20):
        for model, opt, scaler in ((ours_model, ours_opt, ours), (torch_model, torch_opt, theirs)):
            opt.zero_grad()
            x, y = batch(step, device="cuda")
            with torch.autocast("cuda", dtype=dtype):
                loss = (model(x).float() - y).square().mean()
            if step % 5 == 2:
                loss = loss * math.inf
            sync_mode = "error" if scaler is ours else "default"
            torch.cuda.set_sync_debug_mode(sync_mode)
            try:
                scaled = scaler.scale(loss)
                torch.cuda.set_sync_debug_mode("default")
                scaled.backward()
                torch.cuda.set_sync_debug_mode(sync_mode)
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert ours.get_scale() == theirs.get_scale()
        assert bool(ours.step_skipped) == (step % 5 == 2)
        assert_same_params(ours_model, torch_model)


@needs_cuda
def test_cuda_half_grads_with_protocol_optimizer() -> None:
    model = make_model(dtype=torch.float16, device="cuda")
    opt = ProtocolSGDWithCheck(model.parameters())
    scaler = GradScaler("cuda", init_scale=2.0**12)
    scaled_backward(model, scaler, step=0)
    scaled = clone_grads(model)
    scaler.step(opt)
    scaler.update()
    expected = sum((g.double() * 2.0**-12).square().sum() for g in scaled)
    assert opt.grad_norm_squared.item() == pytest.approx(expected.item(), rel=1e-5)
    assert opt.check_calls[0].device.type == "cuda"
    assert not scaler.step_skipped

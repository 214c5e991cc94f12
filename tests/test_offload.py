"""FusedAdamW / FusedSGD with ``offload="cpu"``, against the same optimizer without offload.

The offloaded path runs unchanged with the model on the CPU (plain copies instead of streams), so
its logic is tested here: the backward hooks, gradient accumulation, clipping, the inf skip of
both GradScalers, resuming, schedulers, params edited between steps, the steps in backward and
freed grads; each must leave params and state bitwise equal to the optimizer without offload, in
every mode (params fp32 / bf16 with fp32 masters, remainders or stochastic rounding, moments fp32 /
bf16 / int8). The CUDA tests at the end (streams, page-locked buffers, the same bits as the CPU
step, GPU memory) skip without a GPU.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import needs_cuda
from torch import Tensor, nn

import fusedamp
from fusedamp.optim.offload import buffers, slots, transfers

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("adamw", "sgd")
# (param dtype, master_weights): every way a param is stepped.
PARAM_MODES = [
    (torch.float32, True),
    (torch.bfloat16, True),
    (torch.bfloat16, "remainder"),
    (torch.bfloat16, "stochastic"),
]
MOMENTS = ("fp32", "bf16", "int8")
STEPS = 4


def mode_id(mode: tuple[torch.dtype, Any]) -> str:
    return f"{str(mode[0]).removeprefix('torch.')}-{mode[1]}"


class Net(nn.Module):
    """Three linear layers in ``dtype`` (float32 out), built from ``seed`` alone."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, seed: int = 0, width: int = 32) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.first = nn.Linear(8, width)
            self.middle = nn.Linear(width, width)
            self.last = nn.Linear(width, 4)
        self.to(dtype)
        self.dtype = dtype

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = torch.relu(self.first(inputs.to(self.dtype)))
        hidden = torch.relu(self.middle(hidden))
        return self.last(hidden).float()


def batch(step: int, device: str = "cpu") -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs, target = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    return inputs.to(device), target.to(device)


def make_optimizer(kind: str, params: Any, **options: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return fusedamp.FusedAdamW(params, **{"lr": 1e-2, "weight_decay": 0.1, **options})
    if kind == "muon":  # Net's middle layer in the Muon group (first and last: AdamW)
        groups = [
            {"params": [params[2]]},
            {"params": params[:2] + params[3:], "use_muon": False, "lr": 1e-2},
        ]
        return fusedamp.FusedMuon(groups, **{"lr": 0.02, **options})
    defaults = {"lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    return fusedamp.FusedSGD(params, **{**defaults, **options})


def pair(
    kind: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", **options: Any
) -> tuple[Any, ...]:
    """(model, optimizer) without offload and (model, optimizer) with, from the same weights."""
    reference, offloaded = Net(dtype).to(device), Net(dtype).to(device)
    offload_keys = ("offload_gradients", "step_in_backward", "offload_delay", "offload_delay_warmup")
    offload_options = {key: options.pop(key) for key in offload_keys if key in options}
    return (
        reference,
        make_optimizer(kind, list(reference.parameters()), **options),
        offloaded,
        make_optimizer(kind, list(offloaded.parameters()), offload="cpu", **options, **offload_options),
    )


def loss_of(model: nn.Module, step: int, micro: int = 0) -> Tensor:
    inputs, target = batch(10 * step + micro, next(model.parameters()).device.type)
    return nn.functional.mse_loss(model(inputs), target)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    *,
    scaler: Any = None,
    micro_batches: int = 1,
    no_sync: bool = False,
    corrupt: Callable[[nn.Module, int], None] | None = None,
    clip_by_hand: float | None = None,
    scheduler: Any = None,
) -> None:
    """Per step: zero_grad, ``micro_batches`` backwards (all but the last inside
    offload_no_sync() if ``no_sync``), ``corrupt``, then the step, by hand or through ``scaler``
    (unscale_ and clip_grad_norm_ first with ``clip_by_hand``)."""
    for step in steps:
        opt.zero_grad()
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with nullcontext() if last or not no_sync else opt.offload_no_sync():
                loss = loss_of(model, step, micro)
                (loss if scaler is None else scaler.scale(loss)).backward()
        if corrupt is not None:
            corrupt(model, step)
        if scaler is None:
            if clip_by_hand is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip_by_hand)
            opt.step()
        else:
            if clip_by_hand is not None:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), clip_by_hand)
            scaler.step(opt)
            scaler.update()
        if scheduler is not None:
            scheduler.step()


def bits(tensor: Tensor) -> Tensor:
    """The bit patterns of ``tensor`` (so that NaNs and signed zeros compare too)."""
    tensor = tensor.detach().cpu()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point():
        return tensor
    return tensor.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[tensor.element_size()])


def assert_same_bits(a: Any, b: Any, where: str = "") -> None:
    """Equal nested state_dicts / tensors, tensors bit for bit (devices and layouts aside)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            assert_same_bits(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_bits(x, y, f"{where}[{index}]")
    else:
        assert a == b, (where, a, b)


def assert_same(reference: nn.Module, opt: Any, offloaded: nn.Module, offloaded_opt: Any) -> None:
    for (name, a), b in zip(reference.named_parameters(), offloaded.parameters(), strict=True):
        assert_same_bits(a, b, name)
    expected, actual = opt.state_dict(), offloaded_opt.state_dict()
    for group in actual["param_groups"]:  # the offload keywords are not group options
        assert not {"offload", "offload_gradients"} & set(group)
    assert_same_bits(expected, actual, "state_dict")
    for state in actual["state"].values():
        for value in state.values():
            assert not isinstance(value, Tensor) or value.device.type == "cpu"


# --- asynchronous copies, simulated ----------------------------------------------------------


class _Copy:
    """A copy queued on a simulated stream: done when completed (by a wait, a later copy of the
    same stream completing, or a fence)."""

    def __init__(self, stream: list[_Copy], land: Callable[[], None]) -> None:
        self.stream, self.land, self.done = stream, land, False
        stream.append(self)

    def complete(self) -> None:
        with DeferredTransfers.lock:  # the worker thread of a delayed step waits on copies too
            while not self.done:  # a stream runs its copies in order
                first = self.stream.pop(0)
                first.land()
                first.done = True


class DeferredTransfers(transfers.Transfers):
    """The transfers of a GPU, simulated on the CPU: a copy lands only when its event is waited
    on (or, to the device, at the fence), and until then its destination holds NaN. A read of a
    host buffer before its wait, a write of a host copy still being read by a copy to the device,
    or a param read before the fence shows up as NaN in the results."""

    lock = threading.RLock()

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, False
        self.d2h: list[_Copy] = []
        self.h2d: list[_Copy] = []

    def to_host(self, hosts: Any, sources: Any, after: Any = (), free: bool = False) -> Any:
        if not hosts:
            return None
        for event in after:
            self.wait(event)
        # The device runs the copies after the work queued so far.
        values = [source.detach().clone() for source in sources]
        for host in hosts:
            host.fill_(float("nan"))

        def land() -> None:
            torch._foreach_copy_(list(hosts), values)

        with self.lock:
            return _Copy(self.d2h, land)

    def to_device(self, targets: Any, hosts: Any, after: Any = ()) -> Any:
        if not targets:
            return None
        for event in after:
            self.wait(event)
        for target in targets:
            target.fill_(float("nan"))  # bumps the param's version when queued, as copy_ does

        def land() -> None:
            with torch.no_grad():
                for target, host in zip(targets, hosts, strict=True):
                    target.data.copy_(host)  # reads the host copy when the copy runs

        with self.lock:
            return _Copy(self.h2d, land)

    @staticmethod
    def wait(event: Any) -> None:
        if event is not None:
            event.complete()

    def fence(self) -> None:
        for stream in (self.h2d, self.d2h):
            if stream:
                stream[-1].complete()


@pytest.fixture(params=["copies", "deferred"])
def transfers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with plain copies, then with DeferredTransfers."""
    if request.param == "deferred":
        monkeypatch.setattr(slots, "Transfers", DeferredTransfers)
    return request.param


# --- every mode -----------------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["plain", "clipped"])
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("mode", PARAM_MODES, ids=mode_id)
def test_offloaded_muon_steps_are_bitwise_the_steps_without_offload(
    mode: tuple[torch.dtype, Any], moments: str, max_grad_norm: float | None, transfers: str
) -> None:
    """FusedMuon (its Muon and AdamW groups) offloaded: the host step gives the bits of the step
    without offload."""
    dtype, master_weights = mode
    reference, opt, offloaded, offloaded_opt = pair(
        "muon", dtype, master_weights=master_weights, moments=moments, max_grad_norm=max_grad_norm
    )
    for step in range(STEPS):
        train(reference, opt, range(step, step + 1))
        train(offloaded, offloaded_opt, range(step, step + 1))
        assert_same(reference, opt, offloaded, offloaded_opt)


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["plain", "clipped"])
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("mode", PARAM_MODES, ids=mode_id)
@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_steps_are_bitwise_the_steps_without_offload(
    kind: str, mode: tuple[torch.dtype, Any], moments: str, max_grad_norm: float | None, transfers: str
) -> None:
    """Backward copies every grad through the hooks (none is copied again by step()); the clip
    norm is the one the optimizer without offload takes (0.05 clips every step here)."""
    dtype, master_weights = mode
    reference, opt, offloaded, offloaded_opt = pair(
        kind, dtype, master_weights=master_weights, moments=moments, max_grad_norm=max_grad_norm
    )
    for step in range(STEPS):
        train(reference, opt, range(step, step + 1))
        train(offloaded, offloaded_opt, range(step, step + 1))
        assert_same(reference, opt, offloaded, offloaded_opt)
    counts = offloaded_opt._executor.counts
    assert counts["grads copied in backward"] == 6 * STEPS and counts["grads copied in step"] == 0
    assert counts["params copied to the host"] == 6  # once, at the first backward
    if max_grad_norm is not None:
        assert torch.equal(opt.last_grad_norm, offloaded_opt.last_grad_norm)
        assert offloaded_opt.last_grad_norm > max_grad_norm


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_and_dtypes_torch_takes(kind: str, transfers: str) -> None:
    """channels_last and gapped params (a host copy in the layout the kernels step), float64 and
    complex params (torch's ops and real views), a grad in another order than its param, an fp32
    grad for a bf16 param, a param without a grad: as without offload."""

    def params() -> list[nn.Parameter]:
        generator = torch.Generator().manual_seed(3)
        conv = torch.randn(4, 3, 3, 3, generator=generator).to(memory_format=torch.channels_last)
        return [
            nn.Parameter(conv),
            nn.Parameter(torch.randn(6, 10, generator=generator)[:, ::2]),  # gapped
            nn.Parameter(torch.randn(5, generator=generator, dtype=torch.float64)),
            nn.Parameter(torch.randn(3, 2, generator=generator, dtype=torch.complex64)),
            nn.Parameter(torch.randn(7, 3, generator=generator).bfloat16()),
            nn.Parameter(torch.randn(4, generator=generator).bfloat16()),  # never has a grad
        ]

    def set_grads(params: list[nn.Parameter], step: int) -> None:
        generator = torch.Generator().manual_seed(step)
        for index, param in enumerate(params[:5]):
            grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if index == 0:
                grad = grad.contiguous()  # another order than the channels_last param
            if index == 4:
                grad = grad.float()  # an fp32 grad for a bf16 param
                param.grad_dtype = None
            param.grad = grad

    a, b = params(), params()
    groups = [[{"params": p[:4]}, {"params": p[4:], "master_weights": "remainder"}] for p in (a, b)]
    opt, offloaded = make_optimizer(kind, groups[0]), make_optimizer(kind, groups[1], offload="cpu")
    for step in range(3):
        for p, o in ((a, opt), (b, offloaded)):
            set_grads(p, step)
            o.step()
    for x, y in zip(a, b, strict=True):
        assert_same_bits(x, y)
    assert b[0].is_contiguous(memory_format=torch.channels_last)
    assert_same_bits(opt.state_dict(), offloaded.state_dict())
    assert offloaded._executor.counts["grads copied in step"] == 15  # grads set by hand


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("adamw", {"amsgrad": True, "maximize": True, "master_weights": False, "lr": torch.tensor(0.01)}),
        ("sgd", {"momentum": 0.5, "dampening": 0.1, "nesterov": False, "maximize": True,
                 "lr": torch.tensor(0.05)}),
        ("sgd", {"momentum": 0.0, "nesterov": False, "master_weights": "stochastic", "moments": "int8"}),
    ],
    ids=["adamw-amsgrad-maximize-no-master", "sgd-dampening-maximize", "sgd-no-momentum"],
)
def test_other_options(kind: str, options: dict[str, Any], transfers: str) -> None:
    """amsgrad, maximize, a tensor lr, no master, fp16 params, dampening, no momentum."""
    lr = options.pop("lr", None)
    reference, opt, offloaded, offloaded_opt = pair(kind, torch.float16, **options)
    for o in (opt, offloaded_opt):
        if lr is not None:
            o.param_groups[0]["lr"] = lr.clone()
    train(reference, opt, range(3))
    train(offloaded, offloaded_opt, range(3))
    assert_same(reference, opt, offloaded, offloaded_opt)


# --- AMP, clipping, accumulation ------------------------------------------------------------


def overflow_at(step_to_break: int) -> Callable[[nn.Module, int], None]:
    """Writes an inf into a grad after backward (after the hook copied it) at one step."""

    def corrupt(model: nn.Module, step: int) -> None:
        if step == step_to_break:
            model.middle.weight.grad[1, 2] = float("inf")

    return corrupt


SCALERS = {
    "fusedamp": lambda: fusedamp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    "torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
}


@pytest.mark.parametrize("clip", ["fused", "by hand", None])
@pytest.mark.parametrize("scaler", list(SCALERS))
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scalers_unscale_skip_and_clip(kind: str, scaler: str, clip: str | None, transfers: str) -> None:
    """Half params with fp32 masters (fp16; bf16 for torch's scaler, whose unscale_ refuses fp16
    grads), an inf at step 2: the step is skipped (params, state and step counts untouched) and
    the scale backs off, as without offload; clipping inside the step (max_grad_norm, its norm
    from the read-only pass of fusedamp's scaler) or by hand after scaler.unscale_(). Grads
    rewritten after backward are copied again by step(): the inf written into one, and after
    unscale_() every grad (torch's unscale_ does not bump the grads' versions: step() goes by the
    scaler saying the grads are unscaled)."""
    options = {"max_grad_norm": 0.5} if clip == "fused" else {}
    dtype = torch.float16 if scaler == "fusedamp" else torch.bfloat16
    reference, opt, offloaded, offloaded_opt = pair(kind, dtype, **options)
    scalers = [SCALERS[scaler](), SCALERS[scaler]()]
    clip_by_hand = 0.5 if clip == "by hand" else None
    for (model, o), s in zip(((reference, opt), (offloaded, offloaded_opt)), scalers, strict=True):
        train(model, o, range(5), scaler=s, corrupt=overflow_at(2), clip_by_hand=clip_by_hand)
    assert_same(reference, opt, offloaded, offloaded_opt)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**11  # up, down at the inf, up
    assert offloaded_opt.state_dict()["state"][0]["step"] == 4  # one of five skipped
    counts = offloaded_opt._executor.counts
    assert counts["grads copied in step"] == (6 * 5 if clip == "by hand" else 1)


@pytest.mark.parametrize("no_sync", [False, True], ids=["every backward", "no_sync"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_accumulation(kind: str, no_sync: bool, transfers: str) -> None:
    """Three micro-batches per step: the grads add up on the device; without marking, each
    backward's grads go to the host and the last copy (the sum) is stepped; inside
    offload_no_sync() the first two backwards copy nothing."""
    reference, opt, offloaded, offloaded_opt = pair(kind, max_grad_norm=0.1)
    for model, o in ((reference, opt), (offloaded, offloaded_opt)):
        train(model, o, range(3), micro_batches=3, no_sync=no_sync)
    assert_same(reference, opt, offloaded, offloaded_opt)
    assert offloaded_opt._executor.counts["grads copied in backward"] == 6 * 3 * (1 if no_sync else 3)
    assert offloaded_opt._executor.counts["grads copied in step"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_params_without_grads_and_zeroed_grads(kind: str, transfers: str) -> None:
    """A param backward does not reach has no grad and is not stepped; zero_grad(set_to_none=
    False) keeps zero grads, stepped (weight decay, momentum) as torch steps them."""
    reference, opt, offloaded, offloaded_opt = pair(kind)

    def run(model: Net, o: Any, step: int, set_to_none: bool, frozen: bool) -> None:
        o.zero_grad(set_to_none=set_to_none)
        model.last.bias.requires_grad_(not frozen)
        loss_of(model, step).backward()  # the frozen bias gets no grad
        model.last.bias.requires_grad_(True)
        o.step()

    for step, (set_to_none, frozen) in enumerate([(True, True), (True, False), (False, True), (False, True)]):
        run(reference, opt, step, set_to_none, frozen)
        run(offloaded, offloaded_opt, step, set_to_none, frozen)
        assert_same(reference, opt, offloaded, offloaded_opt)
        if step == 0:
            assert offloaded.last.bias.grad is None and 5 not in offloaded_opt.state_dict()["state"]
    assert offloaded.last.bias.grad is not None and not offloaded.last.bias.grad.any()


# --- state -----------------------------------------------------------------------------------


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_resume_is_bitwise_and_state_dicts_cross_over(kind: str, moments: str, transfers: str) -> None:
    """A state_dict saved mid-run (through torch.save / torch.load(weights_only=True)) resumes
    bitwise in a fresh offloaded optimizer; the same state_dict loads into an optimizer without
    offload and back, as they are the same format."""
    options = {"moments": moments, "master_weights": "remainder", "max_grad_norm": 0.2}
    reference, opt, offloaded, offloaded_opt = pair(kind, **options)
    train(reference, opt, range(6))
    train(offloaded, offloaded_opt, range(3))
    buffer = io.BytesIO()
    torch.save({"model": offloaded.state_dict(), "opt": offloaded_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    for offload in ("cpu", None):
        model = Net(seed=7)  # other weights: the checkpoint overwrites them
        o = make_optimizer(kind, model.parameters(), offload=offload, **options)
        model.load_state_dict(saved["model"])
        o.load_state_dict(saved["opt"])
        train(model, o, range(3, 6))
        assert_same(reference, opt, model, o)
        assert_same_bits(opt.torch_state_dict(), o.torch_state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_lr_scheduler_and_group_changes(kind: str, transfers: str) -> None:
    """A scheduler changes lr at every step; a group option the buckets depend on (moments)
    changes mid-run; a param group added later is offloaded too."""
    reference, opt, offloaded, offloaded_opt = pair(kind)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, offloaded_opt)]
    for model, o, scheduler in ((reference, opt, schedulers[0]), (offloaded, offloaded_opt, schedulers[1])):
        train(model, o, range(2), scheduler=scheduler)
        o.param_groups[0]["moments"] = "int8"
        train(model, o, range(2, 4), scheduler=scheduler)
    assert_same(reference, opt, offloaded, offloaded_opt)

    extra = [nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2)]
    opt.add_param_group({"params": [extra[0]], "master_weights": "remainder"})
    offloaded_opt.add_param_group({"params": [extra[1]], "master_weights": "remainder"})
    for param, o in zip(extra, (opt, offloaded_opt), strict=True):
        param.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
        o.step()
    assert_same_bits(extra[0], extra[1])
    assert_same_bits(opt.state_dict(), offloaded_opt.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_params_edited_between_steps_are_picked_up(kind: str, transfers: str) -> None:
    """In-place edits (clamp_, model.load_state_dict) and a new tensor (p.data = ...) between
    steps, and an edit between backward and step(): the step starts from the edited param, as
    without offload."""
    reference, opt, offloaded, offloaded_opt = pair(kind, master_weights="remainder")
    other = Net(seed=5).state_dict()

    def edits(model: Net, step: int) -> None:
        with torch.no_grad():
            if step == 1:
                model.first.weight.clamp_(-0.05, 0.05)
            elif step == 2:
                model.load_state_dict(other)
            elif step == 3:
                model.middle.weight.data = model.middle.weight.data * 0.5

    def after_backward(model: Net, step: int) -> None:
        if step == 4:
            with torch.no_grad():
                model.last.weight.mul_(0.5)

    for model, o in ((reference, opt), (offloaded, offloaded_opt)):
        for step in range(6):
            edits(model, step)
            train(model, o, range(step, step + 1), corrupt=after_backward)
    assert_same(reference, opt, offloaded, offloaded_opt)
    # At the first step every param, then the clamped one, the six loaded ones, the replaced one,
    # the one changed after backward.
    assert offloaded_opt._executor.counts["params copied to the host"] == 6 + 1 + 6 + 1 + 1


def test_torch_state_dict_master_of_and_state_bytes() -> None:
    reference, opt, offloaded, offloaded_opt = pair("adamw", moments="int8", master_weights="remainder")
    train(reference, opt, range(2))
    train(offloaded, offloaded_opt, range(2))
    assert_same_bits(opt.torch_state_dict(), offloaded_opt.torch_state_dict())
    for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
        assert_same_bits(opt.master_of(a), offloaded_opt.master_of(b))
    plain, measured = opt.state_bytes(), offloaded_opt.state_bytes()
    assert {key: measured[key] for key in plain} == plain
    numel = sum(param.numel() for param in offloaded.parameters())
    assert measured["params"] == measured["grads"] == 2 * numel
    assert measured["device"] == 0
    assert sum(plain.values()) + 4 * numel <= measured["host"] <= sum(plain.values()) + 4 * numel + 12 * 64


@pytest.mark.parametrize(
    ("master_weights", "limit"), [("remainder", 8.1), ("stochastic", 6.1)], ids=["remainder", "stochastic"]
)
def test_host_bytes_per_param(master_weights: str, limit: float) -> None:
    """Host memory of bf16 params with int8 moments, measured from the tensors after a step
    (state_bytes: the state, the host copies of the params and the grad buffers as allocated):
    8.02 B/param with an exact fp32 master, 6.02 with stochastic rounding (DeepSpeed's
    ZeRO-Offload holds 16)."""
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024)).to(torch.bfloat16)
    opt = fusedamp.FusedAdamW(
        model.parameters(), offload="cpu", moments="int8", master_weights=master_weights
    )
    model(torch.randn(4, 1024, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    numel = sum(param.numel() for param in model.parameters())
    assert numel > 4_000_000
    measured = opt.state_bytes()
    host = measured["host"] / numel
    assert host <= limit, measured
    assert host >= limit - 0.1
    assert measured["params"] == measured["grads"] == 2 * numel


# --- offload_gradients, step_in_backward --------------------------------------------------------


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_offload_gradients_frees_the_grads(kind: str, moments: str, transfers: str) -> None:
    """Each grad is freed once on the host (p.grad is None after backward), with the same steps;
    accumulation inside offload_no_sync(); fusedamp.GradScaler's found_inf (an inf at step 2,
    which must skip) from the checks taken in backward."""
    reference, opt, offloaded, offloaded_opt = pair(kind, moments=moments, offload_gradients=True)
    train(reference, opt, range(2), micro_batches=2, no_sync=True)
    train(offloaded, offloaded_opt, range(2), micro_batches=2, no_sync=True)
    assert all(param.grad is None for param in offloaded.parameters())
    assert_same(reference, opt, offloaded, offloaded_opt)

    def train_scaled(model: Net, o: Any, scaler: Any) -> None:
        for step in range(2, 5):
            o.zero_grad()
            loss = loss_of(model, step) * (float("inf") if step == 3 else 1.0)  # inf grads at step 3
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()

    reference2, opt2, offloaded2, offloaded_opt2 = pair(
        kind, torch.float16, moments=moments, offload_gradients=True
    )
    scalers = [SCALERS["fusedamp"](), SCALERS["fusedamp"]()]
    train_scaled(reference2, opt2, scalers[0])
    train_scaled(offloaded2, offloaded_opt2, scalers[1])
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_same(reference2, opt2, offloaded2, offloaded_opt2)
    assert offloaded_opt2.state_dict()["state"][0]["step"] == 2
    assert offloaded_opt2.state_bytes()["device"] == 2 * 4 * 6


def test_offload_gradients_clipping_is_close_and_its_limits_are_errors() -> None:
    """The clip norm of freed grads is summed per grad (agrees with the one-pass norm to float
    rounding); a second backward onto a grad on the host, scaler.unscale_() and torch's
    GradScaler (which read the grads on the params) are clear errors."""
    reference, opt, offloaded, offloaded_opt = pair("adamw", max_grad_norm=0.05, offload_gradients=True)
    train(reference, opt, range(3))
    train(offloaded, offloaded_opt, range(3))
    torch.testing.assert_close(offloaded_opt.last_grad_norm, opt.last_grad_norm, rtol=1e-6, atol=0)
    for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.01, atol=1e-3)

    offloaded_opt.zero_grad()
    loss_of(offloaded, 0).backward()
    with pytest.raises(RuntimeError, match="offload_no_sync"):
        loss_of(offloaded, 1).backward()
    offloaded_opt.zero_grad()

    half = Net(torch.float16)
    half_opt = fusedamp.FusedAdamW(half.parameters(), offload="cpu", offload_gradients=True)
    for scaler, match in ((SCALERS["fusedamp"](), "unscale_"), (SCALERS["torch"](), "torch.amp.GradScaler")):
        half_opt.zero_grad()
        scaler.scale(loss_of(half, 0)).backward()
        if match == "unscale_":
            scaler.unscale_(half_opt)
        with pytest.raises(RuntimeError, match=match):
            scaler.step(half_opt)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("mode", PARAM_MODES[1:], ids=mode_id)
@pytest.mark.parametrize("kind", KINDS)
def test_step_in_backward(
    kind: str, mode: tuple[torch.dtype, Any], offload_gradients: bool, transfers: str
) -> None:
    """Every param is stepped by the worker thread during backward (step() only waits for it),
    bitwise as after backward; accumulation inside offload_no_sync(); a scheduler's lr of the
    step is the one backward uses."""
    dtype, master_weights = mode
    reference, opt, offloaded, offloaded_opt = pair(
        kind, dtype, master_weights=master_weights, moments="int8", step_in_backward=True,
        offload_gradients=offload_gradients,
    )
    schedulers = [torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.25, 3) for o in (opt, offloaded_opt)]
    for (model, o), scheduler in zip(((reference, opt), (offloaded, offloaded_opt)), schedulers, strict=True):
        train(model, o, range(4), micro_batches=2, no_sync=True, scheduler=scheduler)
    assert_same(reference, opt, offloaded, offloaded_opt)
    counts = offloaded_opt._executor.counts
    assert counts["params stepped in backward"] == counts["params stepped"] == 6 * 4


def test_step_in_backward_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        fusedamp.FusedAdamW(Net().parameters(), offload="cpu", step_in_backward=True, max_grad_norm=1.0)
    model = Net(torch.float16)
    opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu", step_in_backward=True)
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="offload_no_sync"):
        loss_of(model, 1).backward()
    scaler = SCALERS["fusedamp"]()
    scaler.scale(torch.ones(()))  # the first backward was not scaled: only its state is wanted
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)


# --- errors and misuse ---------------------------------------------------------------------------


def test_clear_errors() -> None:
    params = list(Net().parameters())
    with pytest.raises(ValueError, match="Invalid offload value"):
        fusedamp.FusedAdamW(params, offload="gpu")
    with pytest.raises(ValueError, match="need offload='cpu'"):
        fusedamp.FusedSGD(params, offload_gradients=True)
    meta = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        fusedamp.FusedAdamW([*params, meta], offload="cpu")
    with pytest.raises(ValueError, match="from a CUDA device"):
        fusedamp.FusedAdamW([meta], offload="cpu")
    opt = fusedamp.FusedAdamW(params, offload="cpu")
    with pytest.raises(ValueError, match="one device"):
        opt.add_param_group({"params": [meta]})
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


def test_dtensor_params_are_refused_with_fsdp2s_own_offload(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))
        with pytest.raises(TypeError, match="CPUOffloadPolicy"):
            fusedamp.FusedAdamW([param], offload="cpu")
    finally:
        dist.destroy_process_group()


def test_a_dropped_optimizer_leaves_no_hooks() -> None:
    model = Net()
    opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu")
    loss_of(model, 0).backward()
    opt.step()
    del opt  # freed at once (no reference cycle): its hooks go with it
    loss_of(model, 0).backward()  # no hook of the dropped optimizer runs (nor fails)
    assert all(not param._post_accumulate_grad_hooks for param in model.parameters())


# --- DDP: two CPU ranks ------------------------------------------------------------------------


def fsdp2_cpu_offload_policy(rank: int) -> dict[str, Any]:
    """FSDP2 with and without CPUOffloadPolicy, FusedAdamW (no offload of its own) in every mode:
    the full params after two clipped steps, per mode and policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    results: dict[str, Any] = {}
    for dtype, master_weights in PARAM_MODES:
        for moments in MOMENTS:
            for policy in (None, CPUOffloadPolicy(pin_memory=False)):
                model = Net(dtype)
                options = {} if policy is None else {"offload_policy": policy}
                for layer in (model.first, model.middle, model.last):
                    fully_shard(layer, **options)
                fully_shard(model, **options)
                opt = fusedamp.FusedAdamW(
                    model.parameters(), lr=1e-2, master_weights=master_weights, moments=moments,
                    max_grad_norm=0.1,
                )
                for step in range(2):
                    inputs, target = batch(step)
                    nn.functional.mse_loss(model(inputs[rank::2]), target[rank::2]).backward()
                    opt.step()
                    opt.zero_grad()
                name = f"{mode_id((dtype, master_weights))}-{moments}"
                place = "plain" if policy is None else "policy"
                full = [param.detach().full_tensor() for param in model.parameters()]
                results.setdefault(name, {})[place] = full
    return results


def ddp_offload_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: DDP with an offloaded FusedAdamW and one without, on this rank's half of each
    batch; both must agree bitwise (the hooks leave the grads to step(), after the all-reduce).
    Then FSDP2's own CPUOffloadPolicy with FusedAdamW (fsdp2_cpu_offload_policy)."""
    import traceback

    from torch.nn.parallel import DistributedDataParallel

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            results = {}
            for offload in (None, "cpu"):
                model = DistributedDataParallel(Net())
                opt = fusedamp.FusedAdamW(model.parameters(), lr=1e-2, offload=offload, max_grad_norm=0.1)
                scaler = fusedamp.GradScaler("cpu", init_scale=2.0**8)
                for step in range(3):
                    inputs, target = batch(step)
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(inputs[rank::2]), target[rank::2])
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                results[str(offload)] = [param.detach().clone() for param in model.parameters()]
                if offload is not None:
                    results["counts"] = dict(opt._executor.counts)
            results["fsdp2"] = fsdp2_cpu_offload_policy(rank)
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from test_distributed import run_ranks

    return run_ranks(ddp_offload_worker, (), tmp_path_factory.mktemp("offload_ranks"))


def test_ddp_with_offload_matches_ddp_without(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        for a, b in zip(rank["None"], rank["cpu"], strict=True):
            assert_same_bits(a, b)
        assert rank["counts"]["grads copied in step"] == 6 * 3
        assert rank["counts"].get("grads copied in backward", 0) == 0


def test_fsdp2_cpu_offload_policy_steps_cpu_shards_in_every_mode(two_ranks: list[dict[str, Any]]) -> None:
    """FSDP2 keeps the shards on the host with CPUOffloadPolicy, and FusedAdamW without offload
    steps them: the same full params as FSDP2 without the policy, on both ranks, every mode."""
    results = [rank["fsdp2"] for rank in two_ranks]
    assert len(results[0]) == len(PARAM_MODES) * len(MOMENTS)
    for name, runs in results[0].items():
        for a, b, c in zip(runs["plain"], runs["policy"], results[1][name]["policy"], strict=True):
            assert_same_bits(a, b, name)
            assert_same_bits(b, c, name)


# --- the example ------------------------------------------------------------------------------


def test_example_runs_on_cpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offload.py"), "--steps", "3", "--width", "128"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "host bytes per param" in done.stdout


# --- CUDA ------------------------------------------------------------------------------------------


def exact_loss(model: nn.Module, coefs: list[Tensor]) -> Tensor:
    """sum(p * c): its grads are the coefficients exactly, on any device."""
    return sum((param * coef).float().sum() for param, coef in zip(model.parameters(), coefs, strict=True))


def coefficients(model: nn.Module, step: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) * 0.1 for p in model.parameters()]


@needs_cuda
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("mode", PARAM_MODES, ids=mode_id)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_offload_is_the_cpu_step_bitwise(kind: str, mode: tuple[torch.dtype, Any], moments: str) -> None:
    """A GPU model, offloaded: the same bits as the same model stepped on the CPU without offload
    (the grads are exact on both devices), and as the GPU step without offload; every grad went
    to the host during backward, into page-locked memory, and the state stayed on the host."""
    dtype, master_weights = mode
    options = {"master_weights": master_weights, "moments": moments}
    cpu_model, gpu_model, gpu_offloaded = Net(dtype), Net(dtype).cuda(), Net(dtype).cuda()
    opts = [
        make_optimizer(kind, cpu_model.parameters(), **options),
        make_optimizer(kind, gpu_model.parameters(), **options),
        make_optimizer(kind, gpu_offloaded.parameters(), offload="cpu", **options),
    ]
    for step in range(STEPS):
        for model, o in zip((cpu_model, gpu_model, gpu_offloaded), opts, strict=True):
            o.zero_grad()
            coefs = [c.to(next(model.parameters()).device) for c in coefficients(model, step)]
            exact_loss(model, coefs).backward()
            o.step()
    assert_same(cpu_model, opts[0], gpu_offloaded, opts[2])
    assert_same(gpu_model, opts[1], gpu_offloaded, opts[2])
    offload = opts[2]._executor
    assert offload.counts["grads copied in backward"] == 6 * STEPS
    assert offload.counts["grads copied in step"] == 0
    assert all(slot.host.is_pinned() and slot.grad.is_pinned() for slot in offload.slots)
    for state in opts[2].state.values():
        for value in state.values():
            assert not isinstance(value, Tensor) or (value.device.type == "cpu" and not value.is_pinned())


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_scaler_clipping_accumulation_resume(kind: str) -> None:
    """fp16 on the GPU with fusedamp.GradScaler, an inf at step 2, max_grad_norm and two micro-
    batches, resumed from a state_dict mid-run: bitwise the GPU optimizer without offload (the norm
    and found_inf are taken on the GPU by the same passes)."""
    reference, opt, offloaded, offloaded_opt = pair(kind, torch.float16, "cuda", max_grad_norm=0.5)
    scalers = [fusedamp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for (model, o), scaler in zip(((reference, opt), (offloaded, offloaded_opt)), scalers, strict=True):
        train(model, o, range(3), scaler=scaler, micro_batches=2, corrupt=overflow_at(2))
    state = offloaded_opt.state_dict()
    resumed = Net(torch.float16, seed=3).cuda()
    resumed.load_state_dict(offloaded.state_dict())
    resumed_opt = make_optimizer(kind, resumed.parameters(), offload="cpu", max_grad_norm=0.5)
    resumed_opt.load_state_dict(state)
    train(reference, opt, range(3, 5), scaler=scalers[0], micro_batches=2)
    train(resumed, resumed_opt, range(3, 5), scaler=scalers[1], micro_batches=2)
    assert_same(reference, opt, resumed, resumed_opt)


@needs_cuda
def test_cuda_offload_gradients_keeps_only_the_params_on_the_gpu() -> None:
    """With offload_gradients each grad is freed once copied: after backward the GPU holds the
    params (2 B/param in bf16) and nothing of the optimizer but two floats per param tensor."""
    torch.cuda.empty_cache()
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]).to("cuda", torch.bfloat16)
    # A backward without the optimizer first: what the GPU holds then besides the params (the
    # cuBLAS workspaces, which torch's allocator counts) is not the optimizer's.
    model(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu", offload_gradients=True, moments="int8")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert baseline >= params
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        assert all(param.grad is None for param in model.parameters())
        opt.step()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # frees the grads kept for the copies (record_stream)
    assert torch.cuda.memory_allocated() <= baseline + (1 << 20)
    assert opt.state_bytes()["device"] == 2 * 4 * 8


@needs_cuda
def test_cuda_step_in_backward_and_the_next_forward() -> None:
    """Steps in backward give the same bits; step() returns without waiting for the copies back,
    and work queued after it on the current stream (here a copy to the host) sees the new params."""
    reference, opt, offloaded, offloaded_opt = pair(
        "adamw", device="cuda", moments="int8", step_in_backward=True
    )
    for model, o in ((reference, opt), (offloaded, offloaded_opt)):
        for step in range(3):
            o.zero_grad()
            exact_loss(model, [c.cuda() for c in coefficients(model, step)]).backward()
            o.step()
            if o is offloaded_opt:
                for slot in o._executor.slots:
                    assert torch.equal(slot.param.cpu(), slot.host)
    assert_same(reference, opt, offloaded, offloaded_opt)
    assert offloaded_opt._executor.counts["params stepped in backward"] == 6 * 3


@needs_cuda
def test_cuda_copies_overlap_backward_and_the_cpu_step() -> None:
    """From a profile: the first grad copy to the host starts before backward's last kernel ends
    (the copies run during backward), and the first param copy back starts before the CPU step
    of the last chunk ends (each chunk goes back while the next one steps)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    layers = 7  # 7 x 16.8M params: several chunks
    model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)])
    model = model.to("cuda", torch.bfloat16)
    opt = fusedamp.FusedAdamW(model.parameters(), offload="cpu", moments="int8", master_weights="remainder")
    inputs = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the second step is profiled (the first makes the state)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            opt.zero_grad()
            with record_function("backward"):
                model(inputs).float().square().mean().backward()
                torch.cuda.synchronize()
            with record_function("offloaded step"):
                opt.step()
            torch.cuda.synchronize()
    events = prof.events()
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    to_host = [e.time_range.start for e in device if "DtoH" in e.name]
    to_device = [e.time_range.start for e in device if "HtoD" in e.name]
    kernels = [e.time_range.end for e in device if "Memcpy" not in e.name and "Memset" not in e.name]
    step = next(e for e in events if e.name == "offloaded step")
    assert len(to_host) >= layers and len(to_device) >= layers
    assert min(to_host) < max(kernels)
    assert min(to_device) < step.time_range.end
    assert opt._executor.counts["grads copied in step"] == 0


def test_host_buffers_are_storages_that_start_on_a_page() -> None:
    """Each allocation of host buffers is a storage of its own that starts on a page: what
    cudaHostRegister locks, and what torch's is_pinned() asks CUDA about (a storage's first byte)."""
    host_buffers = buffers.HostBuffers(pin=False)
    specs = [(torch.Size([3, 5]), (5, 1), torch.float32), (torch.Size([7]), (1,), torch.bfloat16)]
    first, second = host_buffers.allocate(specs)
    block = host_buffers.blocks[0]
    assert block.untyped_storage().data_ptr() == block.data_ptr() and block.data_ptr() % 4096 == 0
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr() == block.data_ptr()
    first.fill_(2.0)
    second.fill_(3.0)
    del host_buffers, block
    assert first.sum().item() == 30.0 and second.sum().item() == 21.0

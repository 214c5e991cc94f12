"""Checkpoint and resume: model + FusedAdamW/FusedSGD (fp32 masters, bf16 remainders) + GradScaler.

A checkpoint written with ``torch.save`` must load with ``torch.load(weights_only=True)`` (only
tensors and plain Python values), and training resumed from it must be bitwise identical to a
run that never stopped, through bf16 autocast and injected gradient overflows.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from helpers import MixedPrecisionNet, amp_train, seeded_batch
from torch import nn

import fusedamp

STEPS = 8
STOP_AT = 4
# Steps whose gradients get an inf (before and after the checkpoint): skipped, scale backed off.
OVERFLOW_STEPS = (2, 5)


def build(
    device: str, optimizer: str
) -> tuple[MixedPrecisionNet, torch.optim.Optimizer, fusedamp.GradScaler]:
    """An fp32 layer, a bf16 layer with an fp32 master, a bf16 layer with a remainder."""
    model = MixedPrecisionNet().to(device)
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = fusedamp.FusedAdamW(model.param_groups(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    else:
        opt = fusedamp.FusedSGD(model.param_groups(), lr=1e-2, momentum=0.9, nesterov=True)
    scaler = fusedamp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    return model, opt, scaler


def train(
    model: MixedPrecisionNet,
    opt: torch.optim.Optimizer,
    scaler: fusedamp.GradScaler,
    steps: range,
    device: str,
) -> None:
    """bf16 autocast; an inf in a grad of the master layer at OVERFLOW_STEPS."""

    def overflow(step: int) -> None:
        if step in OVERFLOW_STEPS:
            model.master.weight.grad[0, 0] = float("inf")

    log = amp_train(
        model, opt, scaler, steps, lambda step: seeded_batch(1000 + step, 16, model, device), corrupt=overflow
    )
    assert log.skipped == [step in OVERFLOW_STEPS for step in steps]


def checkpoint(model: MixedPrecisionNet, opt: torch.optim.Optimizer, scaler: fusedamp.GradScaler) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
        buffer,
    )
    return buffer.getvalue()


def assert_plain(value: Any, where: str = "checkpoint") -> None:
    """Only tensors, None, bool, int, float, str and lists/tuples/dicts of them."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, (str, int)), f"{where}: key {key!r} is a {type(key).__name__}"
            assert_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            assert_plain(item, f"{where}[{index}]")
    else:
        assert value is None or type(value) in (torch.Tensor, nn.Parameter, bool, int, float, str), (
            f"{where} is a {type(value).__name__}"
        )


def assert_bitwise_equal(left: Any, right: Any, where: str = "") -> None:
    if isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_bitwise_equal(left[key], right[key], f"{where}[{key!r}]")
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_bitwise_equal(a, b, f"{where}[{index}]")
    elif isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and left.shape == right.shape, where
        # Compared as bytes: bitwise, and NaN-safe.
        assert torch.equal(_bytes(left), _bytes(right)), where
    else:
        assert left == right, where


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().reshape(-1).view(torch.uint8)


def resume_matches_uninterrupted(device: str, optimizer: str, map_location: str) -> None:
    model, opt, scaler = build(device, optimizer)
    train(model, opt, scaler, range(STEPS), device)
    # The state holds every kind of entry: step tensors, moments, masters and remainders.
    assert {"master", "step"} <= set(opt.state[model.master.weight])
    assert {"master_remainder", "step"} <= set(opt.state[model.remainder.weight])
    assert not torch.equal(
        opt.state[model.remainder.weight]["master_remainder"],
        torch.zeros_like(opt.state[model.remainder.weight]["master_remainder"]),
    )

    first, first_opt, first_scaler = build(device, optimizer)
    train(first, first_opt, first_scaler, range(STOP_AT), device)
    saved = checkpoint(first, first_opt, first_scaler)
    del first, first_opt, first_scaler

    loaded = torch.load(io.BytesIO(saved), weights_only=True, map_location=map_location)
    assert_plain(loaded)
    resumed, resumed_opt, resumed_scaler = build(device, optimizer)
    resumed.load_state_dict(loaded["model"])
    resumed_opt.load_state_dict(loaded["optimizer"])
    resumed_scaler.load_state_dict(loaded["scaler"])
    train(resumed, resumed_opt, resumed_scaler, range(STOP_AT, STEPS), device)

    assert_bitwise_equal(resumed.state_dict(), model.state_dict(), "model")
    assert_bitwise_equal(resumed_opt.state_dict(), opt.state_dict(), "optimizer")
    assert resumed_scaler.state_dict() == scaler.state_dict()
    # Every state tensor lives on its param's device again, whatever map_location was.
    for param, state in resumed_opt.state.items():
        for value in state.values():
            assert value.device == param.device


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cpu_resume_is_bitwise_identical_to_not_stopping(optimizer: str) -> None:
    """8 steps of bf16 autocast with overflows at steps 2 and 5 equal 4 steps, a
    torch.save/torch.load(weights_only=True) round trip into fresh objects, and 4 more steps:
    params, moments, step counts, masters, remainders and the scaler's scale and tracker."""
    resume_matches_uninterrupted("cpu", optimizer, "cpu")


def test_skipped_steps_and_scale_survive_the_checkpoint() -> None:
    """The checkpoint taken after the overflow at step 2 carries the backed-off scale, the
    growth tracker and step counts that did not count the skipped step."""
    model, opt, scaler = build("cpu", "adamw")
    train(model, opt, scaler, range(STOP_AT), "cpu")
    loaded = torch.load(io.BytesIO(checkpoint(model, opt, scaler)), weights_only=True)
    # 2^10 grows to 2^11 after the clean steps 0 and 1, backs off at step 2; step 3 is clean.
    assert loaded["scaler"]["scale"] == 2.0**10
    assert loaded["scaler"]["_growth_tracker"] == 1
    steps = {float(state["step"]) for state in loaded["optimizer"]["state"].values()}
    assert steps == {STOP_AT - 1.0}
    groups = loaded["optimizer"]["param_groups"]
    assert [group["master_weights"] for group in groups] == [True, True, "remainder"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cuda_checkpoint_loads_on_cpu_and_resumes_on_cuda(optimizer: str) -> None:
    """Saved on CUDA, loaded with map_location="cpu" (a machine without a GPU can read it), then
    loaded into CUDA objects: the resumed run is bitwise the uninterrupted CUDA run."""
    resume_matches_uninterrupted("cuda", optimizer, "cpu")

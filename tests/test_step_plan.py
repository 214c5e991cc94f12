"""The optimizers' cached step plan (fusedamp/optim/_plan.py): reused across steps, and rebuilt on
every change a user can make, each checked against torch.optim making the same change."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import fusedamp
from fusedamp.optim import FusedAdamW, FusedSGD

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
SIZES = [7, 130, 1, 33]
TORCH_OF = {FusedAdamW: torch.optim.AdamW, FusedSGD: torch.optim.SGD}
OPTIONS = {FusedAdamW: {"lr": 0.1, "betas": (0.5, 0.75)}, FusedSGD: {"lr": 0.1, "momentum": 0.9}}
BOTH = pytest.mark.parametrize("fused_cls", [FusedAdamW, FusedSGD])


class Twins:
    """A fused optimizer and torch's on fp32 copies of the same params; every change a test makes
    is made to both (``do``), and each step gives both the same new grads, as backward would."""

    def __init__(
        self,
        fused_cls: type,
        dtype: torch.dtype = torch.float32,
        unplanned_ref: bool = False,
        **options: Any,
    ) -> None:
        self.generator = torch.Generator().manual_seed(0)
        initial = [torch.randn(n, generator=self.generator).to(dtype) for n in SIZES]
        self.params = [t.clone().requires_grad_() for t in initial]
        self.refs = [t.float().requires_grad_() for t in initial]
        options = {**OPTIONS[fused_cls], **options}
        self.fused = fused_cls(self.params, **options)
        if unplanned_ref:  # where torch.optim refuses the change: the same class without a plan
            self.ref = fused_cls(self.refs, **options)
            self.ref._planned_buckets = lambda checked=None: self.ref._buckets()
        else:
            self.ref = TORCH_OF[fused_cls](self.refs, **options, foreach=False)
        self.with_grad = list(range(len(SIZES)))

    def do(self, change: Callable[[torch.optim.Optimizer, list[Tensor]], None]) -> None:
        change(self.fused, self.params)
        change(self.ref, self.refs)

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            for index in self.with_grad:
                grad = torch.randn(self.params[index].shape, generator=self.generator)
                self.params[index].grad = grad.to(self.params[index].dtype)
                self.refs[index].grad = self.params[index].grad.float()
            self.fused.step()
            self.ref.step()
            self.fused.zero_grad()
            self.ref.zero_grad()

    def check(self) -> None:
        for param, ref in zip(self.params, self.refs, strict=True):
            torch.testing.assert_close(self.fused.master_of(param), ref.detach(), **TOLERANCE)


def count_builds(monkeypatch: pytest.MonkeyPatch, opt: torch.optim.Optimizer) -> list[int]:
    """A list that gets one entry each time ``opt`` buckets its params anew."""
    builds: list[int] = []
    real = opt._buckets

    def counting() -> Any:
        builds.append(1)
        return real()

    monkeypatch.setattr(opt, "_buckets", counting)
    return builds


@BOTH
def test_the_plan_is_reused_while_backward_makes_new_grads(fused_cls, monkeypatch) -> None:
    twins = Twins(fused_cls, torch.bfloat16)
    builds = count_builds(monkeypatch, twins.fused)
    twins.step(4)
    assert len(builds) == 1
    twins.check()


@BOTH
def test_a_new_param_group(fused_cls, monkeypatch) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    builds = count_builds(monkeypatch, twins.fused)
    extra = [torch.randn(5, generator=twins.generator) for _ in range(2)]
    twins.params += [t.clone().requires_grad_() for t in extra]
    twins.refs += [t.clone().requires_grad_() for t in extra]
    twins.with_grad += [len(SIZES), len(SIZES) + 1]
    twins.fused.add_param_group({"params": twins.params[-2:], "lr": 0.3})
    twins.ref.add_param_group({"params": twins.refs[-2:], "lr": 0.3})
    twins.step(2)
    assert len(builds) == 1
    twins.check()


@BOTH
def test_a_grad_that_appears_and_disappears(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.with_grad = [0, 1, 3]
    twins.step(2)
    twins.with_grad = [0, 1, 2, 3]
    twins.step(2)
    twins.with_grad = [0, 3]  # zero_grad(set_to_none=True) left params 1 and 2 without grads
    twins.step(2)
    twins.check()


@BOTH
def test_a_grad_of_another_dtype(fused_cls) -> None:
    twins = Twins(fused_cls, torch.bfloat16)
    twins.step(2)
    original = twins.fused.step

    def step_with_fp32_grads() -> None:
        for param in twins.params:
            param.grad_dtype = None  # torch refuses a grad of another dtype by default
            param.grad = param.grad.float()
        original()

    twins.fused.step = step_with_fp32_grads
    twins.step(2)
    twins.check()


def test_changed_hyperparameters_are_used() -> None:
    twins = Twins(FusedAdamW)
    twins.step(2)

    def change(opt: torch.optim.Optimizer, _: list[Tensor]) -> None:
        opt.param_groups[0].update(lr=0.02, betas=(0.25, 0.5), eps=1e-3, weight_decay=0.5)

    twins.do(change)
    twins.step(2)
    twins.check()


def test_momentum_switched_on_makes_its_buffers() -> None:
    # The new buffers start as the grad, as torch.optim.SGD starts a missing buffer.
    twins = Twins(FusedSGD, momentum=0.0)
    twins.step(2)
    twins.do(lambda opt, _: opt.param_groups[0].update(momentum=0.5, dampening=0.25))
    twins.step(2)
    twins.check()
    assert "momentum_buffer" in twins.fused.state[twins.params[0]]


def test_amsgrad_switched_on() -> None:
    twins = Twins(FusedAdamW, unplanned_ref=True)  # torch.optim.AdamW raises a KeyError
    twins.step(2)
    twins.do(lambda opt, _: opt.param_groups[0].update(amsgrad=True))
    twins.step(2)
    twins.check()
    assert "max_exp_avg_sq" in twins.fused.state[twins.params[0]]


@BOTH
def test_master_weights_changed(fused_cls) -> None:
    twins = Twins(fused_cls, torch.bfloat16)
    twins.step(2)
    twins.fused.param_groups[0]["master_weights"] = "remainder"
    twins.step(2)
    assert "master_remainder" in twins.fused.state[twins.params[0]]
    assert "master" not in twins.fused.state[twins.params[0]]
    twins.check()  # the remainder keeps the fp32 master exactly


@BOTH
def test_a_param_replaced_in_its_group(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    # The old param keeps getting grads (a module still uses it) but is no longer stepped.
    old, old_value = twins.params[1], twins.params[1].detach().clone()
    fresh = torch.randn(SIZES[1], generator=twins.generator)
    twins.params[1] = fresh.clone().requires_grad_()
    twins.refs[1] = fresh.clone().requires_grad_()
    twins.fused.param_groups[0]["params"][1] = twins.params[1]
    twins.ref.param_groups[0]["params"][1] = twins.refs[1]
    original = twins.fused.step

    def step_with_a_grad_for_the_old_param() -> None:
        old.grad = torch.ones_like(old)
        original()

    twins.fused.step = step_with_a_grad_for_the_old_param
    twins.step(2)
    twins.check()
    assert twins.fused.state[twins.params[1]]["step"].item() == 2.0
    assert torch.equal(old.detach(), old_value)


@BOTH
def test_param_data_replaced(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    fresh = torch.randn(SIZES[0], generator=twins.generator)

    def change(_: torch.optim.Optimizer, params: list[Tensor]) -> None:
        params[0].data = fresh.clone()

    twins.do(change)
    twins.step(2)
    twins.check()


@BOTH
def test_param_data_of_another_dtype_gets_a_master(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    twins.params[0].data = twins.params[0].data.bfloat16()
    twins.step(1)
    state = twins.fused.state[twins.params[0]]
    assert state["master"].dtype == torch.float32
    assert torch.equal(twins.params[0].detach(), state["master"].bfloat16())


@BOTH
def test_a_state_entry_replaced(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    key = "exp_avg" if fused_cls is FusedAdamW else "momentum_buffer"

    def change(opt: torch.optim.Optimizer, params: list[Tensor]) -> None:
        opt.state[params[1]][key] = torch.full_like(params[1].detach(), 0.5)

    twins.do(change)
    twins.step(2)
    twins.check()


@BOTH
def test_a_params_state_deleted(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    twins.do(lambda opt, params: opt.state.pop(params[2]))
    twins.step(2)
    twins.check()


@BOTH
def test_the_state_replaced(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)

    def reset(opt: torch.optim.Optimizer, _: list[Tensor]) -> None:
        opt.state = defaultdict(dict)

    twins.do(reset)
    twins.step(2)
    twins.check()


@BOTH
def test_load_state_dict(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.step(2)
    saved = [twins.fused.state_dict(), twins.ref.state_dict()]
    snapshot = [p.detach().clone() for p in twins.params]
    twins.step(3)

    def restore(opt: torch.optim.Optimizer, params: list[Tensor]) -> None:
        opt.load_state_dict(saved[opt is twins.ref])
        with torch.no_grad():
            for param, value in zip(params, snapshot, strict=True):
                param.copy_(value)

    twins.do(restore)
    twins.step(2)
    twins.check()


@BOTH
def test_a_grad_scaler_sees_each_steps_new_grads(fused_cls) -> None:
    twins = Twins(fused_cls)
    twins.fused.max_grad_norm = 1.0  # the read-only pass also takes the norm
    scaler = fusedamp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    skipped = []
    for step in range(4):
        for param in twins.params:
            param.grad = torch.randn(param.shape, generator=twins.generator) * 4.0
        if step == 2:
            twins.params[3].grad[0] = float("inf")
        before = [p.detach().clone() for p in twins.params]
        scaler.step(twins.fused)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, twins.params, strict=True)))
    assert skipped == [False, False, True, False]


@BOTH
def test_planned_steps_bump_the_versions_of_what_they_write(fused_cls) -> None:
    # Autograd finds a saved tensor changed in place by its version counter.
    twins = Twins(fused_cls)
    twins.step(1)
    key = "exp_avg" if fused_cls is FusedAdamW else "momentum_buffer"
    state = twins.fused.state[twins.params[0]]
    before = (twins.params[0]._version, state[key]._version, state["step"]._version)
    twins.step(1)
    after = (twins.params[0]._version, state[key]._version, state["step"]._version)
    assert twins.fused._plan.buckets[0].call.unboxed
    assert all(b < a for b, a in zip(before, after, strict=True))
    product = (twins.params[1] * twins.params[1]).sum()
    twins.step(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()


@BOTH
def test_a_scaled_step_checks_its_plan_once(fused_cls, monkeypatch) -> None:
    """fusedamp.GradScaler.step() runs the read-only pass, then step(): the plan the pass found
    fitting is not checked again by the scaler's mesh question or by the step."""
    from fusedamp.optim._plan import StepPlan

    twins = Twins(fused_cls)
    scaler = fusedamp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for param in twins.params:
        param.grad = torch.randn(param.shape, generator=twins.generator)
    scaler.step(twins.fused)  # builds the plan
    scaler.update()
    checks: list[int] = []
    real = StepPlan.fits
    monkeypatch.setattr(StepPlan, "fits", lambda plan, opt: checks.append(1) or real(plan, opt))
    for _ in range(3):
        for param in twins.params:
            param.grad = torch.randn(param.shape, generator=twins.generator)
        scaler.step(twins.fused)
        scaler.update()
    assert len(checks) == 3
    assert twins.fused._checked_plan is None


@BOTH
def test_a_checked_plan_is_forgotten_when_the_scaled_step_fails(fused_cls, monkeypatch) -> None:
    """A failure between the read-only pass and step() (here: in the scaler's look at the ranks)
    leaves no trusted plan behind: a param replaced afterwards is seen by the next step."""
    import fusedamp.grad_scaler as grad_scaler

    twins = Twins(fused_cls, unplanned_ref=True)
    twins.step(2)
    scaler = fusedamp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))

    def failing(*args: Any) -> None:
        raise RuntimeError("rank check failed")

    monkeypatch.setattr(grad_scaler, "_combine_ranks", failing)
    for param in twins.params:
        param.grad = torch.randn(param.shape, generator=twins.generator)
    with pytest.raises(RuntimeError, match="rank check failed"):
        scaler.step(twins.fused)
    assert twins.fused._checked_plan is None
    assert not hasattr(twins.fused, "grad_scale") and not hasattr(twins.fused, "found_inf")
    fresh = torch.randn(SIZES[1], generator=twins.generator)
    twins.params[1] = fresh.clone().requires_grad_()
    twins.refs[1] = fresh.clone().requires_grad_()
    twins.fused.param_groups[0]["params"][1] = twins.params[1]
    twins.ref.param_groups[0]["params"][1] = twins.refs[1]
    twins.step(1)
    twins.check()
    assert twins.fused.state[twins.params[1]]["step"].item() == 1.0

"""The contracts that Lightning / Fabric, accelerate (and the HF Trainer on it) rely on, with
plain torch: the suite does not install those clients (README, "Compatibility")."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusedamp
from fusedamp import FusedAdamW, FusedSGD

LIGHTNING_CHECK = """
def _optimizer_handles_unscaling(optimizer):
    return getattr(optimizer, "_step_supports_amp_scaling", False)
"""


def lightning_check(module_name: str):
    """Lightning's own test (lightning/fabric/plugins/precision/amp.py), run from a module of
    that name: MixedPrecision refuses gradient clipping when it returns True."""
    namespace = {"__name__": module_name}
    exec(LIGHTNING_CHECK, namespace)
    return namespace["_optimizer_handles_unscaling"]


@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD])
def test_lightning_and_fabric_see_an_optimizer_they_may_clip(cls) -> None:
    opt = cls([nn.Parameter(torch.randn(3))], lr=0.1)
    for module in (
        "lightning.fabric.plugins.precision.amp",
        "lightning_fabric.plugins.precision.amp",
        "pytorch_lightning.plugins.precision.native_amp",
    ):
        assert lightning_check(module)(opt) is False
    # torch's GradScaler (and fusedamp's) still leave the unscaling to the fused step.
    assert lightning_check("torch.amp.grad_scaler")(opt) is True
    assert getattr(opt, "_step_supports_amp_scaling", False) is True


def _scaled_run(
    opt_cls, clip: bool, flag: bool | None = None, steps: int = 4
) -> tuple[list[torch.Tensor], list[int]]:
    """Lightning's "16-mixed" step with gradient_clip_val, in plain torch: the loss scaled by a
    torch.amp.GradScaler, unscale_ (as Lightning does for optimizers it may clip), clipping with
    torch, scaler.step and update. An overflow at step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = opt_cls(model.parameters(), lr=1e-2)
    if flag is not None:
        opt._step_supports_amp_scaling = flag
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    calls = []
    original_step = opt.step

    def counted_step(*args, **kwargs):
        calls.append(1)
        return original_step(*args, **kwargs)

    opt.step = counted_step
    handles_unscaling = lightning_check("lightning.fabric.plugins.precision.amp")
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(5, 8, generator=generator)
        if step == 2:
            inputs[0, 0] = float("inf")
        loss = model(inputs).square().mean()
        scaler.scale(loss).backward()
        if not handles_unscaling(opt):
            scaler.unscale_(opt)
        if clip:
            assert not handles_unscaling(opt)  # else Lightning raises "does not allow for gradient clipping"
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], calls


@pytest.mark.parametrize(
    ("fused_cls", "torch_cls"), [(FusedAdamW, torch.optim.AdamW), (FusedSGD, torch.optim.SGD)]
)
def test_lightning_amp_step_with_clipping_matches_torch(fused_cls, torch_cls) -> None:
    ours, calls = _scaled_run(fused_cls, clip=True)
    theirs, _ = _scaled_run(torch_cls, clip=True)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The fused step is called on the overflow step too: it skips in its kernel (no host sync).
    assert len(calls) == 4


def test_forcing_the_flag_false_lets_accelerate_see_a_skipped_step() -> None:
    """accelerate's step_was_skipped is "optimizer.step was not called by scaler.step": the fused
    step is always called. The documented workaround, opt._step_supports_amp_scaling = False,
    makes the scaler sync and leave the overflow step out, with torch's results."""
    ours, calls = _scaled_run(FusedAdamW, clip=False, flag=False)
    theirs, torch_calls = _scaled_run(torch.optim.AdamW, clip=False)
    assert len(calls) == len(torch_calls) == 3
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fusedamp_grad_scaler_is_a_torch_grad_scaler() -> None:
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    assert isinstance(scaler, torch.amp.GradScaler)
    saved = copy.deepcopy(scaler.state_dict())
    # accelerate's FSDP2 load_state: load_state_dict, then the lazy init on the scaler's device.
    loaded = fusedamp.GradScaler("cpu")
    loaded.load_state_dict(saved)
    loaded._lazy_init_scale_growth_tracker(loaded._device)
    assert loaded.get_scale() == 2.0**8
    assert loaded._check_scale_growth_tracker("step")[0].item() == 2.0**8
    # The hysteresis tracker exists too: update() after a step works.
    param = nn.Parameter(torch.randn(4))
    opt = FusedAdamW([param])
    loaded.scale(param.sum()).backward()
    loaded.step(opt)
    loaded.update()
    assert loaded.get_scale() == 2.0**8

"""torch.compile: FusedAdamW/FusedSGD steps driven by fusedamp.GradScaler, compiled with
``fullgraph=True`` (any graph break fails), compute bitwise what eager mode computes.

tests/test_grad_scaler.py compiles the scaler around a test-only optimizer; these compile the
real fused optimizers, with fp32 masters, bf16 remainders, fused clipping and an overflow.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fusedamp

STEPS = 5
OVERFLOW_STEP = 3


def train(
    compile_with: str | None, optimizer: str, unscale_first: bool
) -> tuple[nn.Module, list[bool], float]:
    """Five steps; ``compile_with`` None is eager, else the backend of the step function (the
    forward compiles with aot_eager: inductor's C++ build of it would only cost time)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
    groups = [
        {"params": list(model[0].parameters()), "master_weights": True},
        {"params": list(model[2].parameters()), "master_weights": "remainder"},
    ]
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = fusedamp.FusedAdamW(groups, lr=1e-2, max_grad_norm=1.0)
    else:
        opt = fusedamp.FusedSGD(groups, lr=1e-2, momentum=0.9, max_grad_norm=1.0)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)

    def scaled_loss(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = (model(inputs).float() - target).square().mean()
        return scaler.scale(loss)

    def step_and_update() -> torch.Tensor:
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return scaler.step_skipped

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = scaled_loss
    step: Callable[[], torch.Tensor] = step_and_update
    if compile_with is not None:
        forward = torch.compile(scaled_loss, backend="aot_eager", fullgraph=True)
        step = torch.compile(step_and_update, backend=compile_with, fullgraph=True)
    skipped = []
    for index in range(STEPS):
        generator = torch.Generator().manual_seed(index)
        inputs = torch.randn(8, 4, generator=generator).to(torch.bfloat16)
        target = torch.randn(8, 2, generator=generator)
        opt.zero_grad()
        forward(inputs, target).backward()
        if index == OVERFLOW_STEP:
            model[0].weight.grad[0, 0] = float("nan")
        skipped.append(bool(step()))
    return model, skipped, scaler.get_scale()


@pytest.mark.parametrize(
    ("backend", "optimizer", "unscale_first"),
    [("inductor", "adamw", False), ("aot_eager", "sgd", False), ("aot_eager", "adamw", True)],
)
def test_compiled_scaled_step_matches_eager(backend: str, optimizer: str, unscale_first: bool) -> None:
    """scale() in a compiled forward, [unscale_(),] step() and update() in one compiled function:
    no graph break, the overflow step is skipped, scales and params are eager's, bitwise."""
    eager_model, eager_skipped, eager_scale = train(None, optimizer, unscale_first)
    compiled_model, compiled_skipped, compiled_scale = train(backend, optimizer, unscale_first)
    assert eager_skipped == compiled_skipped == [i == OVERFLOW_STEP for i in range(STEPS)]
    # 2^8 grows after steps 1 (to 2^9), backs off at 3 (to 2^8).
    assert compiled_scale == eager_scale == 2.0**8
    for eager, compiled in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        assert torch.equal(eager, compiled)
    # The model did train (the comparison is not between two untouched models).
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
    assert not torch.equal(initial[0].weight, compiled_model[0].weight)

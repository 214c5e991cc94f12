"""torch.compile: FusedAdamW/FusedSGD steps driven by fusedamp.GradScaler, compiled with
``fullgraph=True`` (any graph break fails), compute bitwise what eager mode computes.

tests/test_grad_scaler.py compiles the scaler around a test-only optimizer; these compile the
real fused optimizers, with fp32 masters, bf16 remainders, fused clipping and an overflow.
"""

from __future__ import annotations

import pytest
import torch
from helpers import MixedPrecisionNet, amp_train, seeded_batch
from torch import nn

import fusedamp

STEPS = 5
OVERFLOW_STEP = 3
FEATURES = (4, 8, 8, 2)


def train(
    compile_with: str | None, optimizer: str, unscale_first: bool
) -> tuple[nn.Module, list[bool], float]:
    """Five steps; ``compile_with`` None is eager, else the backend of the step function (the
    forward compiles with aot_eager: inductor's C++ build of it would only cost time)."""
    torch._dynamo.reset()
    model = MixedPrecisionNet(FEATURES)
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = fusedamp.FusedAdamW(model.param_groups(), lr=1e-2, max_grad_norm=1.0)
    else:
        opt = fusedamp.FusedSGD(model.param_groups(), lr=1e-2, momentum=0.9, max_grad_norm=1.0)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)

    def overflow(step: int) -> None:
        if step == OVERFLOW_STEP:
            model.master.weight.grad[0, 0] = float("nan")

    log = amp_train(
        model,
        opt,
        scaler,
        range(STEPS),
        lambda step: seeded_batch(step, 8, model),
        corrupt=overflow,
        autocast=None,
        compile_with=compile_with,
        unscale_first=unscale_first,
    )
    return model, log.skipped, scaler.get_scale()


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
    initial = MixedPrecisionNet(FEATURES)
    for layer in ("fp32", "master", "remainder"):
        assert not torch.equal(getattr(initial, layer).weight, getattr(compiled_model, layer).weight)

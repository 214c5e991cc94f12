"""Hypothesis property tests of sgd_, check_and_norm_ and update_scale_ against float64 / plain
Python references over random shapes, dtypes, hyperparameters and values (unscale_ and adamw_
have theirs in test_bad_inputs.py)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedamp import ops

FLOAT_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
SIZES = st.lists(st.integers(0, 40), min_size=1, max_size=6)


def random_values(seed: int, count: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64) * scale


@settings(max_examples=30, deadline=None)
@given(
    sizes=SIZES,
    param_dtype=FLOAT_DTYPES,
    seed=st.integers(0, 2**31 - 1),
    first_step=st.booleans(),
    lr=st.floats(1e-4, 1.0),
    momentum=st.one_of(st.just(0.0), st.floats(0.01, 0.99)),
    dampening=st.floats(0.0, 0.9),
    weight_decay=st.floats(0.0, 0.1),
    maximize=st.booleans(),
    nesterov=st.booleans(),
)
def test_sgd_matches_float64(
    sizes: list[int],
    param_dtype: torch.dtype,
    seed: int,
    first_step: bool,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    maximize: bool,
    nesterov: bool,
) -> None:
    """One sgd_ step (fp32 masters for half params) against torch.optim.SGD's rule in float64."""
    if nesterov:
        dampening = 0.0
    half = param_dtype != torch.float32
    masters = [random_values(seed + 3 * i, n).float() for i, n in enumerate(sizes)]
    grads = [random_values(seed + 3 * i + 1, n).to(param_dtype) for i, n in enumerate(sizes)]
    buffers = [random_values(seed + 3 * i + 2, n, 0.1).float() for i, n in enumerate(sizes)]
    params = [master.to(param_dtype) for master in masters]
    expected = []
    for master, param, grad, buffer in zip(masters, params, grads, buffers, strict=True):
        p = (master if half else param).double()
        g = -grad.double() if maximize else grad.double()
        g = g + weight_decay * p
        b = buffer.double()
        if momentum != 0.0:
            b = g if first_step else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        expected.append((p - lr * g, b))
    work_masters = [master.clone() for master in masters] if half else []
    steps = [torch.full((), 0.0 if first_step else 3.0) for _ in sizes]
    ops.sgd_(
        params,
        grads,
        buffers if momentum != 0.0 else [],
        work_masters,
        steps,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
    )
    for index, (want_param, want_buffer) in enumerate(expected):
        updated = work_masters[index] if half else params[index]
        torch.testing.assert_close(updated.double(), want_param, rtol=1e-5, atol=1e-6)
        if momentum != 0.0:
            torch.testing.assert_close(buffers[index].double(), want_buffer, rtol=1e-5, atol=1e-6)
        if half:
            assert torch.equal(params[index], work_masters[index].to(param_dtype))
        assert steps[index].item() == (1.0 if first_step else 4.0)


@settings(max_examples=30, deadline=None)
@given(
    sizes=SIZES,
    dtypes=st.lists(FLOAT_DTYPES, min_size=6, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-10, 16),
    poison=st.sampled_from([None, "inf", "-inf", "nan"]),
)
def test_check_and_norm_matches_float64(
    sizes: list[int], dtypes: list[torch.dtype], seed: int, exponent: int, poison: str | None
) -> None:
    """The read-only pass: the grads are untouched, found_inf is 1 iff any value is inf/NaN, and
    the sum of squares of the unscaled grads is within fp32 accumulation error of float64."""
    scale = 2.0**exponent
    grads = [random_values(seed + i, n, scale).to(dtypes[i]) for i, n in enumerate(sizes)]
    if poison is not None and grads[0].numel():
        grads[0][0] = float(poison)
    before = [grad.clone() for grad in grads]
    found_inf = torch.zeros(())
    total = torch.zeros(())
    inv_scale = torch.tensor(1.0 / scale)
    ops.check_and_norm_(grads, found_inf, total, inv_scale)
    for grad, original in zip(grads, before, strict=True):
        assert torch.equal(
            grad.view(torch.int16 if grad.element_size() == 2 else torch.int32),
            original.view(torch.int16 if original.element_size() == 2 else torch.int32),
        )
    poisoned = any(not torch.isfinite(grad).all() for grad in before)
    assert found_inf.item() == (1.0 if poisoned else 0.0)
    if not poisoned:
        want = sum(float((grad.double() / scale).square().sum()) for grad in before)
        assert math.isclose(total.item(), want, rel_tol=1e-5, abs_tol=1e-30)


def torch_rule(
    state: tuple[float, int, int],
    found_inf: bool,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> tuple[float, int, int]:
    """The loss-scale rule of csrc/include/fusedamp/math/scale.h, in plain Python (fp32 scale)."""
    scale, tracker, left = state
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    if found_inf:
        left = max(left - 1, 0)
        if left == 0:
            scale = max(f32(scale * backoff), min_scale)
        return scale, 0, left
    if tracker + 1 < interval:
        return scale, tracker + 1, left
    grown = min(f32(scale * growth), max_scale)
    return (grown if math.isfinite(grown) else scale), 0, hysteresis


@settings(max_examples=40, deadline=None)
@given(
    found=st.lists(st.booleans(), min_size=1, max_size=40),
    growth=st.floats(1.01, 4.0),
    backoff=st.floats(0.05, 0.99),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    bounded=st.booleans(),
)
def test_update_scale_follows_the_rule(
    found: list[bool], growth: float, backoff: float, interval: int, hysteresis: int, bounded: bool
) -> None:
    min_scale, max_scale = (64.0, 2.0**20) if bounded else (0.0, math.inf)
    scale = torch.tensor(1024.0)
    tracker = torch.zeros((), dtype=torch.int32)
    left = torch.full((), hysteresis, dtype=torch.int32)
    state = (1024.0, 0, hysteresis)
    for overflow in found:
        ops.update_scale_(
            scale,
            tracker,
            left,
            torch.tensor(3.0 if overflow else 0.0),
            growth,
            backoff,
            interval,
            hysteresis,
            min_scale,
            max_scale,
        )
        state = torch_rule(state, overflow, growth, backoff, interval, hysteresis, min_scale, max_scale)
        assert (scale.item(), int(tracker), int(left)) == state

"""Hypothesis property tests of the list and scale ops against their op-table references."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_table import OP_TABLE, assert_matches_reference, schema_args

FLOAT_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
SIZES = st.lists(st.integers(0, 40), min_size=1, max_size=6)
SEEDS = st.integers(0, 2**31 - 1)
POISON = st.sampled_from([None, math.inf, -math.inf, math.nan])


def random_values(seed: int, count: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64) * scale


@settings(max_examples=30, deadline=None)
@given(sizes=SIZES, dtype=FLOAT_DTYPES, seed=SEEDS, scale_exponent=st.integers(-12, 12), poison=POISON)
def test_unscale(
    sizes: list[int], dtype: torch.dtype, seed: int, scale_exponent: int, poison: float | None
) -> None:
    """One fp32 multiply by inv_scale rounded once to the grad dtype (exact against the
    reference); found_inf is 1 iff any value is inf/NaN."""
    grads = [random_values(seed + i, size, 2.0**scale_exponent).to(dtype) for i, size in enumerate(sizes)]
    if poison is not None and grads[-1].numel():
        grads[-1][-1] = poison
    inv_scale = torch.tensor(2.0**-scale_exponent * 1.25)
    assert_matches_reference(OP_TABLE["unscale_"], (grads, torch.zeros(()), inv_scale))


@settings(max_examples=30, deadline=None)
@given(
    sizes=SIZES,
    dtypes=st.lists(FLOAT_DTYPES, min_size=6, max_size=6),
    seed=SEEDS,
    exponent=st.integers(-10, 16),
    poison=POISON,
)
def test_check_and_norm(
    sizes: list[int], dtypes: list[torch.dtype], seed: int, exponent: int, poison: float | None
) -> None:
    """The read-only pass over mixed dtypes: grads untouched, found_inf 1 iff any value is
    inf/NaN (fp16 overflows at the larger scales included), the sum of squares of the unscaled
    grads within fp32 accumulation error of float64."""
    scale = 2.0**exponent
    grads = [random_values(seed + i, n, scale).to(dtypes[i]) for i, n in enumerate(sizes)]
    if poison is not None and grads[0].numel():
        grads[0][0] = poison
    args = (grads, torch.zeros(()), torch.full((), 0.5), torch.tensor(1.0 / scale))
    assert_matches_reference(OP_TABLE["check_and_norm_"], args)


@settings(max_examples=40, deadline=None)
@given(
    found=st.lists(st.sampled_from([0.0, 0.0, 1.0, 3.0, math.nan]), min_size=1, max_size=40),
    growth=st.floats(1.01, 4.0),
    backoff=st.floats(0.05, 0.99),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    bounded=st.booleans(),
)
def test_update_scale_sequence(
    found: list[float], growth: float, backoff: float, interval: int, hysteresis: int, bounded: bool
) -> None:
    """Up to 40 updates in a row, each against the reference rule from the state the op left."""
    min_scale, max_scale = (64.0, 2.0**20) if bounded else (0.0, math.inf)
    state = (
        torch.tensor(1024.0),
        torch.zeros((), dtype=torch.int32),
        torch.tensor(hysteresis, dtype=torch.int32),
    )
    for found_inf in found:
        args = (*state, torch.tensor(found_inf), growth, backoff, interval, hysteresis, min_scale, max_scale)
        updated, _ = assert_matches_reference(OP_TABLE["update_scale_"], args)
        state = updated[:3]


@settings(max_examples=30, deadline=None)
@given(
    sizes=SIZES,
    param_dtype=FLOAT_DTYPES,
    seed=SEEDS,
    step=st.integers(0, 50),
    lr=st.floats(1e-5, 1e-1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    weight_decay=st.floats(0.0, 0.5),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
)
def test_adamw(
    sizes: list[int],
    param_dtype: torch.dtype,
    seed: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """One step (fp32 masters for half params): moments and masters within fp32 rounding of
    float64, a half param its master rounded to nearest even, the steps counted."""
    half = param_dtype != torch.float32
    masters = [random_values(seed + 3 * i, size).float() for i, size in enumerate(sizes)]
    exp_avgs = [random_values(seed + 3 * i + 2, size, 0.1).float() for i, size in enumerate(sizes)]
    exp_avg_sqs = [exp_avg.square() * 1.5 for exp_avg in exp_avgs]
    args = schema_args(
        "adamw_",
        params=[master.to(param_dtype) for master in masters],
        grads=[random_values(seed + 3 * i + 1, size).to(param_dtype) for i, size in enumerate(sizes)],
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        max_exp_avg_sqs=[v * 1.1 for v in exp_avg_sqs] if amsgrad else [],
        masters=masters if half else [],
        steps=[torch.full((), float(step)) for _ in sizes],
        lr=lr,
        lr_tensor=None,
        beta1=beta1,
        beta2=beta2,
        eps=1e-8,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        inv_grad_scale=None,
        found_inf=None,
        clip_coef=None,
        write_unscaled_grads=True,
    )
    assert_matches_reference(OP_TABLE["adamw_"], args)


@settings(max_examples=30, deadline=None)
@given(
    sizes=SIZES,
    param_dtype=FLOAT_DTYPES,
    seed=SEEDS,
    first_step=st.booleans(),
    lr=st.floats(1e-4, 1.0),
    momentum=st.one_of(st.just(0.0), st.floats(0.01, 0.99)),
    dampening=st.floats(0.0, 0.9),
    weight_decay=st.floats(0.0, 0.1),
    maximize=st.booleans(),
    nesterov=st.booleans(),
)
def test_sgd(
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
    """One step (fp32 masters for half params) against torch.optim.SGD's rule in float64."""
    half = param_dtype != torch.float32
    masters = [random_values(seed + 3 * i, n).float() for i, n in enumerate(sizes)]
    args = schema_args(
        "sgd_",
        params=[master.to(param_dtype) for master in masters],
        grads=[random_values(seed + 3 * i + 1, n).to(param_dtype) for i, n in enumerate(sizes)],
        momentum_buffers=[random_values(seed + 3 * i + 2, n, 0.1).float() for i, n in enumerate(sizes)]
        if momentum != 0.0
        else [],
        masters=masters if half else [],
        steps=[torch.full((), 0.0 if first_step else 3.0) for _ in sizes],
        lr=lr,
        lr_tensor=None,
        momentum=momentum,
        dampening=0.0 if nesterov else dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        inv_grad_scale=None,
        found_inf=None,
        clip_coef=None,
        write_unscaled_grads=True,
    )
    assert_matches_reference(OP_TABLE["sgd_"], args)

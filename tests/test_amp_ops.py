"""AMP ops beyond the op table: agreement with torch's AMP ops, scale sequences, wrapper errors."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from conftest import needs_cuda
from op_table import OP_TABLE, assert_unchanged, clone_args, snapshot

from fusedamp import ops

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
UNSCALE_SAMPLES = [
    pytest.param(dtype, index, id=f"{str(dtype).removeprefix('torch.')}-{sample.name}")
    for dtype in OP_TABLE["unscale_"].dtypes
    for index, sample in enumerate(OP_TABLE["unscale_"].samples("cpu", dtype))
]


def scalar(value: float, device: str) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "index"), UNSCALE_SAMPLES)
def test_unscale_matches_torch(device: str, dtype: torch.dtype, index: int) -> None:
    """On the op table's samples: the same grads as torch's op, bit for bit (any NaN matching
    any NaN), and the same found_inf. Where torch has no such op for a grad's dtype (bf16 on CUDA,
    also among mixed dtypes), against what its kernels compute: the product in float32, rounded
    once to the grad's dtype, from fresh copies (torch may have unscaled other dtypes' grads)."""
    grads, found_inf, inv_scale = OP_TABLE["unscale_"].samples(device, dtype)[index].args
    theirs = clone_args((grads, found_inf, inv_scale))
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(*theirs)
    except NotImplementedError:
        assert device == "cuda" and any(grad.dtype == torch.bfloat16 for grad in grads)
        theirs = clone_args((grads, found_inf, inv_scale))
        for grad in theirs[0]:
            if not grad.isfinite().all():
                theirs[1].fill_(1.0)
            grad.copy_(grad.float() * theirs[2])
    ours = clone_args((grads, found_inf, inv_scale))
    torch.ops.fusedamp.unscale_(*ours)
    for mine, torchs in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(mine, torchs, rtol=0, atol=0, equal_nan=True)
    assert ours[1].item() == theirs[1].item()


WRAPPER_BAD_INPUTS = [
    # (what is wrong, wrapper call with that input, error type, message): errors of fusedamp.ops
    # itself, before the op (which tests/op_table.py covers) is called.
    (
        "int grad",
        lambda: ([torch.randn(3), torch.ones(3, dtype=torch.int64)], scalar(0, "cpu"), scalar(0.5, "cpu")),
        ops.unscale_,
        TypeError,
        r"unscale_: grads\[1\] has dtype torch.int64; expected a floating point or complex dtype",
    ),
    (
        "sparse grad",
        lambda: ([torch.randn(3), torch.randn(3).to_sparse()], scalar(0, "cpu")),
        ops.check_and_norm_,
        TypeError,
        r"check_and_norm_: grads\[1\] has layout torch.sparse_coo; pass dense \(strided\) tensors",
    ),
]


@pytest.mark.parametrize(
    ("make_args", "call", "error", "message"),
    [case[1:] for case in WRAPPER_BAD_INPUTS],
    ids=[case[0] for case in WRAPPER_BAD_INPUTS],
)
def test_wrapper_refuses_and_writes_nothing(
    make_args: Callable[[], tuple], call: Callable[..., None], error: type[Exception], message: str
) -> None:
    args = make_args()
    before = snapshot(args)
    with pytest.raises(error, match=message):
        call(*args)
    assert_unchanged(before, args)


def run_update(
    device: str, state: tuple[float, int, int], found_inf: float, *config
) -> tuple[float, int, int]:
    scale, growth, hysteresis = state
    tensors = (
        scalar(scale, device),
        torch.tensor(growth, dtype=torch.int32, device=device),
        torch.tensor(hysteresis, dtype=torch.int32, device=device),
    )
    ops.update_scale_(*tensors, scalar(found_inf, device), *config)
    return tensors[0].item(), int(tensors[1].item()), int(tensors[2].item())


def check_update_scale_sequence(
    device: str, seed: int, growth_factor: float, backoff_factor: float, growth_interval: int
) -> None:
    """200 random updates without hysteresis or bounds: ours and torch._amp_update_scale_ agree."""
    rng = random.Random(seed)
    ours = (torch.tensor(rng.uniform(1.0, 2.0**20)).item(), 0, 1)
    torch_state = (scalar(ours[0], device), torch.zeros((), dtype=torch.int32, device=device))
    scales = set()
    for _ in range(200):
        # found_inf != 0 means overflow, whatever the value: it may be a sum over devices.
        found_inf = rng.choice([0.0, 0.0, 0.0, 1.0, 3.0])
        ours = run_update(device, ours, found_inf, growth_factor, backoff_factor, growth_interval)
        torch._amp_update_scale_(
            *torch_state, scalar(found_inf, device), growth_factor, backoff_factor, growth_interval
        )
        assert ours[:2] == (torch_state[0].item(), torch_state[1].item())
        scales.add(ours[0])
    assert len(scales) > 10  # it grew and backed off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factors", [(2.0, 0.5), (4.0, 0.25), (1.5, 0.75)], ids=str)
@pytest.mark.parametrize("growth_interval", [1, 3])
def test_update_scale_follows_torch(device: str, factors: tuple[float, float], growth_interval: int) -> None:
    check_update_scale_sequence(device, growth_interval, *factors, growth_interval)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factors", [(1.7, 0.3), (3.3, 0.9), (1.01, 0.05)], ids=str)
def test_update_scale_rounds_like_torch_for_any_factor(device: str, factors: tuple[float, float]) -> None:
    """Factors that float32 cannot hold: torch multiplies the fp32 scale by the float64 factor
    and rounds once; rounding the factor to fp32 first is off by an ulp now and then."""
    check_update_scale_sequence(device, 7, *factors, growth_interval=2)


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_hysteresis(device: str) -> None:
    """With hysteresis 3 the scale backs off at the third overflow in a row, then at every
    further one, until a growth step refills the allowance."""
    config = (2.0, 0.5, 2, 3, 0.0, math.inf)
    state = (1024.0, 0, 3)
    steps = [
        (1.0, (1024.0, 0, 2)),
        (0.0, (1024.0, 1, 2)),  # a clean step alone does not refill
        (1.0, (1024.0, 0, 1)),
        (1.0, (512.0, 0, 0)),
        (1.0, (256.0, 0, 0)),
        (0.0, (256.0, 1, 0)),
        (0.0, (512.0, 0, 3)),  # growth refills
        (2.0, (512.0, 0, 2)),
    ]
    for found_inf, expected in steps:
        state = run_update(device, state, found_inf, *config)
        assert state == expected


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_bounds(device: str) -> None:
    low, high = 100.0, 1000.0
    config = (2.0, 0.5, 1, 1, low, high)
    state = (300.0, 0, 1)
    for expected in (150.0, 100.0, 100.0):
        state = run_update(device, state, 1.0, *config)
        assert state[0] == expected
    for expected in (200.0, 400.0, 800.0, 1000.0, 1000.0):
        state = run_update(device, state, 0.0, *config)
        assert state[0] == expected

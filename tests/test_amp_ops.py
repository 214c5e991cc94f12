"""The AMP ops (unscale_, check_and_norm_, update_scale_) against PyTorch references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import needs_cuda

from fusedamp import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Lists of tensor sizes: one element, an odd size, more than two CPU chunks (2^15 elements
# each), an empty list, a zero-element tensor among others, and many tensors of odd sizes.
SIZE_LISTS = {
    "one": [1],
    "seven": [7],
    "65537": [65537],
    "empty_list": [],
    "with_empty_tensor": [5, 0, 33],
    "500_tensors": [random.Random(500).randrange(1, 300) for _ in range(500)],
}
NON_FINITE = {"finite": None, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def random_grads(
    sizes: list[int], dtype: torch.dtype, device: str, seed: int, non_finite: float | None = None
) -> list[torch.Tensor]:
    """Random grads with magnitudes up to ~1e3 (finite in fp16); ``non_finite`` is written at
    a few random positions of random tensors."""
    generator = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=generator) * 300).to(dtype) for n in sizes]
    filled = [g for g in grads if g.numel()]
    if non_finite is not None and filled:
        rng = random.Random(seed)
        for _ in range(3):
            grad = rng.choice(filled)
            grad[rng.randrange(grad.numel())] = non_finite
    return [g.to(device) for g in grads]


def has_non_finite(grads: list[torch.Tensor]) -> bool:
    return any(not g.isfinite().all() for g in grads)


def assert_same_values(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Bitwise equal, except that any NaN matches any NaN (payloads differ between roundings)."""
    assert [a.shape for a in actual] == [e.shape for e in expected]
    if actual:
        flat = [torch.cat([t.flatten() for t in tensors]) for tensors in (actual, expected)]
        torch.testing.assert_close(*flat, rtol=0, atol=0, equal_nan=True)


def scalar(value: float, device: str) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def check_unscale(device: str, dtype: torch.dtype, sizes: list[int], non_finite: float | None) -> None:
    grads = random_grads(sizes, dtype, device, seed=len(sizes), non_finite=non_finite)
    # Not a power of two, so every product is rounded.
    inv_scale = scalar(1.0 / 3000.0, device)
    expected = [(g.float() * inv_scale).to(dtype) for g in grads]
    torch_grads = [g.clone() for g in grads]
    torch_found_inf = scalar(0.0, device)
    torch._amp_foreach_non_finite_check_and_unscale_(torch_grads, torch_found_inf, inv_scale)

    found_inf = scalar(0.0, device)
    ops.unscale_(grads, found_inf, inv_scale)

    assert_same_values(grads, expected)
    assert_same_values(grads, torch_grads)
    assert found_inf.item() == float(has_non_finite(torch_grads))
    assert found_inf.item() == torch_found_inf.item()


def check_check_and_norm(device: str, dtype: torch.dtype, sizes: list[int], non_finite: float | None) -> None:
    grads = random_grads(sizes, dtype, device, seed=len(sizes) + 1, non_finite=non_finite)
    before = [g.clone() for g in grads]
    inv_scale = scalar(1.0 / 700.0, device)
    initial = 0.25  # the op adds to sum_of_squares
    sum_of_squares = scalar(initial, device)
    found_inf = scalar(0.0, device)

    ops.check_and_norm_(grads, found_inf, sum_of_squares, inv_scale)

    assert_same_values(grads, before)
    assert found_inf.item() == float(has_non_finite(grads))
    if non_finite is None:
        # The kernel sums in fp32 per chunk of 2^15 elements (per SIMD lane on CPU); its error
        # grows like sqrt(terms per lane) * 2^-24, ~1e-5 here. The reference sums in float64.
        unscaled = [(g.float() * inv_scale).double() for g in grads]
        expected = initial + sum(u.square().sum().item() for u in unscaled)
        assert sum_of_squares.item() == pytest.approx(expected, rel=5e-5)


@pytest.mark.parametrize("non_finite", NON_FINITE.values(), ids=NON_FINITE.keys())
@pytest.mark.parametrize("sizes", SIZE_LISTS.values(), ids=SIZE_LISTS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscale_cpu(cpu_isa: str, dtype: torch.dtype, sizes: list[int], non_finite: float | None) -> None:
    check_unscale("cpu", dtype, sizes, non_finite)


@pytest.mark.parametrize("non_finite", NON_FINITE.values(), ids=NON_FINITE.keys())
@pytest.mark.parametrize("sizes", SIZE_LISTS.values(), ids=SIZE_LISTS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_and_norm_cpu(
    cpu_isa: str, dtype: torch.dtype, sizes: list[int], non_finite: float | None
) -> None:
    check_check_and_norm("cpu", dtype, sizes, non_finite)


@needs_cuda
@pytest.mark.parametrize("non_finite", NON_FINITE.values(), ids=NON_FINITE.keys())
@pytest.mark.parametrize("sizes", SIZE_LISTS.values(), ids=SIZE_LISTS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unscale_cuda(dtype: torch.dtype, sizes: list[int], non_finite: float | None) -> None:
    check_unscale("cuda", dtype, sizes, non_finite)


@needs_cuda
@pytest.mark.parametrize("non_finite", NON_FINITE.values(), ids=NON_FINITE.keys())
@pytest.mark.parametrize("sizes", SIZE_LISTS.values(), ids=SIZE_LISTS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_and_norm_cuda(dtype: torch.dtype, sizes: list[int], non_finite: float | None) -> None:
    check_check_and_norm("cuda", dtype, sizes, non_finite)


DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_call(device: str) -> None:
    grads = [random_grads([257], dtype, device, seed=i)[0] for i, dtype in enumerate(DTYPES)]
    expected = [(g.float() * 0.125).to(g.dtype) for g in grads]
    found_inf = scalar(0.0, device)
    ops.unscale_(grads, found_inf, scalar(0.125, device))
    for grad, reference in zip(grads, expected, strict=True):
        assert torch.equal(grad, reference)
    grads[1][100] = math.inf
    ops.check_and_norm_(grads, found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["unscale_", "check_and_norm_"])
def test_found_inf_is_only_ever_set(device: str, op: str) -> None:
    """All finite leaves found_inf as it was (it may hold other devices' results); any
    non-finite sets it to 1."""
    run = {
        "unscale_": lambda grads, found_inf: ops.unscale_(grads, found_inf, scalar(0.5, device)),
        "check_and_norm_": lambda grads, found_inf: ops.check_and_norm_(grads, found_inf),
    }[op]
    for previous in (0.0, 1.0, 2.5):
        found_inf = scalar(previous, device)
        run(random_grads([100, 3], torch.float16, device, seed=3), found_inf)
        assert found_inf.item() == previous
        found_inf = scalar(previous, device)
        run(random_grads([100, 3], torch.float16, device, seed=3, non_finite=math.nan), found_inf)
        assert found_inf.item() == 1.0


def test_check_and_norm_without_optional_arguments(cpu_isa: str) -> None:
    grads = random_grads([1000, 31], torch.bfloat16, "cpu", seed=4)
    sum_of_squares = scalar(0.0, "cpu")
    ops.check_and_norm_(grads, scalar(0.0, "cpu"), sum_of_squares)  # inv_scale defaults to 1
    expected = sum(g.double().square().sum().item() for g in grads)
    assert sum_of_squares.item() == pytest.approx(expected, rel=5e-5)
    found_inf = scalar(0.0, "cpu")
    grads[0][7] = -math.inf
    ops.check_and_norm_(grads, found_inf)  # no sum_of_squares: only the check
    assert found_inf.item() == 1.0


BAD_INPUTS = [
    # (what is wrong, op call with that input, error type, message)
    (
        "int grad",
        lambda: ops.unscale_([torch.ones(3, dtype=torch.int32)], scalar(0, "cpu"), scalar(1, "cpu")),
        TypeError,
        r"unscale_: grads\[0\] has dtype torch.int32; expected a floating point or complex dtype",
    ),
    (
        "int grad, the op itself",
        lambda: torch.ops.fusedamp.unscale_(
            [torch.ones(3, dtype=torch.int32)], scalar(0, "cpu"), scalar(1, "cpu")
        ),
        TypeError,
        r"unscale_: grads\[0\] has dtype Int; expected float32, float16 or bfloat16",
    ),
    (
        "float64 grad, the op itself",
        lambda: torch.ops.fusedamp.check_and_norm_(
            [torch.ones(3), torch.ones(3, dtype=torch.float64)], scalar(0, "cpu"), None, None
        ),
        TypeError,
        r"check_and_norm_: grads\[1\] has dtype Double",
    ),
    (
        "half found_inf",
        lambda: ops.unscale_([torch.ones(3)], torch.zeros((), dtype=torch.half), scalar(1, "cpu")),
        TypeError,
        "unscale_: found_inf must be a float32 tensor, got Half",
    ),
    (
        "two-element inv_scale",
        lambda: ops.unscale_([torch.ones(3)], scalar(0, "cpu"), torch.ones(2)),
        RuntimeError,
        r"unscale_: inv_scale must hold exactly one element, got shape \[2\]",
    ),
    (
        "overlapping grad, the op itself",
        lambda: torch.ops.fusedamp.unscale_(
            [torch.ones(1, 4).expand(4, 4)], scalar(0, "cpu"), scalar(1, "cpu")
        ),
        RuntimeError,
        r"unscale_: grads\[0\] has gaps or overlaps in memory \(sizes \[4, 4\], strides \[0, 1\]\)",
    ),
    (
        "sparse grad",
        lambda: ops.check_and_norm_([torch.ones(3).to_sparse()], scalar(0, "cpu")),
        TypeError,
        r"check_and_norm_: grads\[0\] has layout torch.sparse_coo; pass dense \(strided\) tensors",
    ),
    (
        "sparse grad, the op itself",
        lambda: torch.ops.fusedamp.check_and_norm_([torch.ones(3).to_sparse()], scalar(0, "cpu"), None, None),
        NotImplementedError,
        "Could not run 'fusedamp::check_and_norm_' with arguments from the 'SparseCPU' backend",
    ),
    (
        "int64 sum_of_squares",
        lambda: ops.check_and_norm_([torch.ones(3)], scalar(0, "cpu"), torch.zeros((), dtype=torch.int64)),
        TypeError,
        "check_and_norm_: sum_of_squares must be a float32 tensor, got Long",
    ),
    (
        "float growth tracker",
        lambda: ops.update_scale_(
            scalar(1, "cpu"),
            torch.zeros(()),
            torch.ones((), dtype=torch.int32),
            scalar(0, "cpu"),
            2.0,
            0.5,
            10,
        ),
        TypeError,
        "update_scale_: growth_tracker must be a one-element int32 tensor, got Float",
    ),
    (
        "zero growth interval",
        lambda: ops.update_scale_(
            scalar(1, "cpu"),
            torch.zeros((), dtype=torch.int32),
            torch.ones((), dtype=torch.int32),
            scalar(0, "cpu"),
            2.0,
            0.5,
            0,
        ),
        ValueError,
        "growth_interval and hysteresis must be positive, got 0 and 1",
    ),
]


@pytest.mark.parametrize("call,error,message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_rejected(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


@needs_cuda
def test_found_inf_on_another_device_is_rejected() -> None:
    with pytest.raises(RuntimeError, match="unscale_: grads\\[0\\] is on cpu, expected cuda:0"):
        ops.unscale_([torch.ones(3)], scalar(0, "cuda"), scalar(1, "cuda"))


def torch_update_scale(
    scale: float,
    growth_tracker: int,
    found_inf: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[float, int]:
    """torch._amp_update_scale_'s rule in Python: products in float64, rounded to float32."""
    if found_inf > 0:
        return to_f32(scale * backoff_factor), 0
    if growth_tracker + 1 < growth_interval:
        return scale, growth_tracker + 1
    grown = to_f32(scale * growth_factor)
    return (scale if math.isinf(grown) else grown), 0


def to_f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


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
    """200 random updates: ours, the Python reference and torch._amp_update_scale_ agree."""
    rng = random.Random(seed)
    ours = (to_f32(rng.uniform(1.0, 2.0**20)), 0, 1)
    reference = ours[:2]
    torch_state = (scalar(ours[0], device), torch.zeros((), dtype=torch.int32, device=device))
    for _ in range(200):
        # found_inf > 0 means overflow, whatever the value: it may be a sum over devices.
        found_inf = rng.choice([0.0, 0.0, 0.0, 1.0, 3.0])
        ours = run_update(device, ours, found_inf, growth_factor, backoff_factor, growth_interval)
        reference = torch_update_scale(*reference, found_inf, growth_factor, backoff_factor, growth_interval)
        torch._amp_update_scale_(
            *torch_state, scalar(found_inf, device), growth_factor, backoff_factor, growth_interval
        )
        assert ours[:2] == reference
        assert ours[:2] == (torch_state[0].item(), torch_state[1].item())


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
def test_update_scale_never_grows_to_inf(device: str) -> None:
    state = (3.0e38, 0, 1)
    assert run_update(device, state, 0.0, 2.0, 0.5, 1) == (pytest.approx(3.0e38), 0, 1)


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


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    grads = random_grads([3, 0, 70], torch.float32, device, seed=5) + random_grads(
        [9], torch.bfloat16, device, seed=6
    )
    inv_scale = scalar(0.5, device)
    torch.library.opcheck(torch.ops.fusedamp.unscale_.default, (grads, scalar(0.0, device), inv_scale))
    for sum_of_squares, inv in [(scalar(0.0, device), inv_scale), (None, None)]:
        torch.library.opcheck(
            torch.ops.fusedamp.check_and_norm_.default, (grads, scalar(0.0, device), sum_of_squares, inv)
        )
    trackers = [torch.tensor(v, dtype=torch.int32, device=device) for v in (1, 2)]
    torch.library.opcheck(
        torch.ops.fusedamp.update_scale_.default,
        (scalar(8.0, device), *trackers, scalar(0.0, device), 2.0, 0.5, 2, 2, 1.0, 1e6),
    )


@pytest.mark.parametrize("found_inf", [math.nan, -1.0, 3.0])
def test_update_scale_backs_off_on_any_found_inf_but_zero(found_inf: float) -> None:
    # [note: found_inf]: a NaN found_inf (a NaN summed into a count) is an overflow, not growth.
    assert run_update("cpu", (1024.0, 5, 1), found_inf, 2.0, 0.5, 6) == (512.0, 0, 0)
    assert run_update("cpu", (1024.0, 5, 1), 0.0, 2.0, 0.5, 6) == (2048.0, 0, 1)

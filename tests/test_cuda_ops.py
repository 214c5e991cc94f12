"""The CUDA kernels against the CPU backend beyond tests/op_table.py (which runs every op's
samples on both and compares them with float64): misaligned views, chunk boundaries, more tensors
than one launch takes, streams, multi-step optimizer runs and bitwise agreement.

Every test builds its inputs on CPU, runs the op on a CPU copy and a CUDA copy, and compares.
Values computed with one fp32 multiply (unscaled grads, steps, found_inf) must match bitwise;
optimizer states may differ by a few fp32 ulps (nvcc contracts a * b + c into FMAs), and half
params by one ulp of their dtype (rounding the fp32 master that differs by an ulp). With inputs
that make every product exact, the optimizers must match bitwise too, NaNs and infs included.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from op_table import master_value

import fusedamp
import fusedamp.ops as ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = "cuda"
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Empty tensors first, last, consecutive and between non-empty ones; one block covers 65536
# elements: 65537 takes two, the second with one element.
SIZES_WITH_EMPTY = [0, 1, 0, 0, 7, 65537, 0]
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 2e-3, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
}


def randn(size: int, dtype: torch.dtype, generator: torch.Generator, offset: int = 0) -> torch.Tensor:
    """A CPU tensor of `size` normal values; with `offset`, a view that starts `offset` elements
    into its storage, so that the CUDA copy is misaligned for vector accesses."""
    storage = torch.randn(size + offset, generator=generator).to(dtype)
    return storage[offset:]


def to_device(tensors: list[torch.Tensor], device: str, offset: int = 0) -> list[torch.Tensor]:
    """Copies keeping the storage offset of each CPU view (so misalignment carries over)."""
    copies = []
    for t in tensors:
        storage = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)
        copies.append(storage[offset:].view(t.shape).copy_(t))
    return copies


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values (NaN payloads and the sign of zero aside), compared on CPU."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


def assert_bits_unchanged(after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    for a, b in zip(after, before, strict=True):
        assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCE[expected.dtype])


# --- unscale_ -----------------------------------------------------------------------------


def grads_of(
    dtypes: list[torch.dtype], sizes: list[int], seed: int = 0, offset: int = 0
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [randn(size, dtype, generator, offset) * 100 for size, dtype in zip(sizes, dtypes, strict=True)]


def run_unscale(grads: list[torch.Tensor], inv_scale: float, found: float = 0.0, offset: int = 0):
    """unscale_ on CPU copies and CUDA copies of `grads`; returns ((grads, found_inf) per device)."""
    results = []
    for device in ("cpu", CUDA):
        copies = to_device(grads, device, offset)
        found_inf = torch.tensor(found, device=device)
        ops.unscale_(copies, found_inf, torch.tensor(inv_scale, device=device))
        results.append((copies, found_inf))
    return results


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_unscale_matches_cpu_and_torch(dtype: torch.dtype, offset: int) -> None:
    grads = grads_of([dtype] * len(SIZES_WITH_EMPTY), SIZES_WITH_EMPTY, offset=offset)
    (cpu, cpu_found), (cuda, cuda_found) = run_unscale(grads, 0.3, offset=offset)
    for g, c, u in zip(grads, cpu, cuda, strict=True):
        assert_same(u, c)
        assert_same(u, (g.float() * torch.tensor(0.3)).to(dtype))
    assert cuda_found.item() == cpu_found.item() == 0.0


def test_unscale_mixed_dtypes_and_many_tiny_tensors() -> None:
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 21, (1000,), generator=generator).tolist()
    dtypes = [FLOAT_DTYPES[i % 3] for i in range(1000)]
    grads = grads_of(dtypes, sizes, seed=2) + grads_of(FLOAT_DTYPES, [65537, 3, 65536], seed=3)
    (cpu, _), (cuda, found) = run_unscale(grads, 2.0**-7)
    for c, u in zip(cpu, cuda, strict=True):
        assert_same(u, c)
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [(1, 0), (5, 65536), (5, 30000), (4, 6)])
def test_unscale_finds_non_finite(dtype: torch.dtype, bad: float, where: tuple[int, int]) -> None:
    grads = grads_of([dtype] * len(SIZES_WITH_EMPTY), SIZES_WITH_EMPTY)
    tensor, index = where
    grads[tensor][index] = bad
    (cpu, cpu_found), (cuda, cuda_found) = run_unscale(grads, 0.5)
    assert cuda_found.item() == cpu_found.item() == 1.0
    for c, u in zip(cpu, cuda, strict=True):
        assert_same(u, c)


def test_unscale_leaves_found_inf_as_it_was_when_finite() -> None:
    grads = grads_of([torch.float16, torch.float32], [100, 100])
    (_, cpu_found), (_, cuda_found) = run_unscale(grads, 0.5, found=3.0)
    assert cuda_found.item() == cpu_found.item() == 3.0


def test_unscale_runs_on_the_current_stream() -> None:
    grad = torch.ones(1 << 20, device=CUDA)
    found_inf, inv_scale = torch.zeros((), device=CUDA), torch.tensor(0.5, device=CUDA)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        # If unscale_ ran on another stream it would finish before the fill, leaving 2.0.
        torch.cuda._sleep(50_000_000)
        grad.fill_(2.0)
        ops.unscale_([grad], found_inf, inv_scale)
    torch.cuda.synchronize()
    assert torch.all(grad == 1.0)


@pytest.mark.large
def test_unscale_tensor_larger_than_2_pow_31_elements() -> None:
    numel = 2**31 + 1000
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GB of free GPU memory")
    grad = torch.full((numel,), 3.0, dtype=torch.float16, device=CUDA)
    grad[-1] = 5.0
    grad[2**31 - 1] = 7.0
    found_inf = torch.zeros((), device=CUDA)
    ops.unscale_([grad], found_inf, torch.tensor(0.5, device=CUDA))
    assert found_inf.item() == 0.0
    assert grad[-1].item() == 2.5
    assert grad[2**31 - 1].item() == 3.5
    assert torch.all(grad[-1000:-1] == 1.5) and torch.all(grad[2**31 - 2000 : 2**31 - 1] == 1.5)
    assert torch.all(grad[:1000] == 1.5)
    grad[-1] = math.inf
    ops.unscale_([grad], found_inf, torch.tensor(1.0, device=CUDA))
    assert found_inf.item() == 1.0


# --- check_and_norm_ ----------------------------------------------------------------------


def run_check(grads: list[torch.Tensor], device: str, inv_scale: float | None, start: float = 0.0):
    copies = to_device(grads, device)
    found_inf = torch.zeros((), device=device)
    sum_of_squares = torch.tensor(start, device=device)
    inv = None if inv_scale is None else torch.tensor(inv_scale, device=device)
    ops.check_and_norm_(copies, found_inf, sum_of_squares, inv)
    assert_bits_unchanged(copies, grads)
    return found_inf, sum_of_squares


def test_check_and_norm_is_bitwise_reproducible() -> None:
    generator = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 300_000, (60,), generator=generator).tolist() + [0, 5] * 300
    grads = grads_of([FLOAT_DTYPES[i % 3] for i in range(len(sizes))], sizes, seed=5)
    first = run_check(grads, CUDA, 0.25)[1]
    second = run_check(grads, CUDA, 0.25)[1]
    assert torch.equal(bits(first.cpu()), bits(second.cpu()))
    assert first.item() == pytest.approx(run_check(grads, "cpu", 0.25)[1].item(), rel=1e-5)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("with_sum", [False, True])
def test_check_and_norm_finds_non_finite(bad: float, with_sum: bool) -> None:
    for tensor, index in [(1, 0), (5, 65536), (4, 3)]:
        grads = grads_of([torch.bfloat16] * len(SIZES_WITH_EMPTY), SIZES_WITH_EMPTY)
        grads[tensor][index] = bad
        found_inf = torch.zeros((), device=CUDA)
        sum_of_squares = torch.zeros((), device=CUDA) if with_sum else None
        ops.check_and_norm_(to_device(grads, CUDA), found_inf, sum_of_squares, None)
        assert found_inf.item() == 1.0


def test_check_and_norm_of_only_empty_grads_reads_no_uninitialized_memory() -> None:
    # A private pool whose only free memory held NaN: a buffer the op reads without writing it
    # (per-block partials when no block runs) turns the sum into NaN instead of, often, zeros.
    found_inf = torch.zeros((), device=CUDA)
    sum_of_squares = torch.tensor(0.25, device=CUDA)
    grads = [torch.empty(0, dtype=dtype, device=CUDA) for dtype in FLOAT_DTYPES]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        # Two 1 MiB blocks (the largest the small pool serves): its whole first 2 MiB segment.
        nan_blocks = [torch.full((2**17,), math.nan, dtype=torch.float64, device=CUDA) for _ in range(2)]
        del nan_blocks
        ops.check_and_norm_(grads, found_inf, sum_of_squares, torch.tensor(0.5, device=CUDA))
        torch.cuda.synchronize()
    assert found_inf.item() == 0.0
    assert sum_of_squares.item() == 0.25


# --- update_scale_ ------------------------------------------------------------------------


def test_update_scale_matches_cpu_step_by_step() -> None:
    states = {
        device: (
            torch.tensor(2.0**16, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
            torch.tensor(2, dtype=torch.int32, device=device),
        )
        for device in ("cpu", CUDA)
    }
    found_sequence = [0, 0, 0, 1, 0, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    for found in found_sequence:
        for device, (scale, growth, hysteresis) in states.items():
            ops.update_scale_(
                scale,
                growth,
                hysteresis,
                torch.tensor(float(found), device=device),
                4.0,
                0.25,
                3,
                hysteresis=2,
                min_scale=2.0**10,
                max_scale=2.0**20,
            )
        for cpu_value, cuda_value in zip(states["cpu"], states[CUDA], strict=True):
            assert torch.equal(cuda_value.cpu(), cpu_value)


LAUNCH_SETTINGS = [
    {"param_bytes": 4096},
    {"param_bytes": 0, "chunk_size": 2**12, "grad_unroll": 8},
    {"param_bytes": 4096, "chunk_size": 2**18, "grad_unroll": 2},
]


@pytest.mark.parametrize("settings", LAUNCH_SETTINGS, ids=str)
def test_grad_ops_under_every_launch_setting(settings: dict) -> None:
    sizes = torch.randint(0, 300, (1200,), generator=torch.Generator().manual_seed(23)).tolist() + [300_001]
    dtypes = [FLOAT_DTYPES[i % 3] for i in range(len(sizes))]
    grads = grads_of(dtypes, sizes, seed=24)
    grads[1200][300_000] = math.inf
    previous = fusedamp._C.set_cuda_launch_settings(**settings)
    try:
        (cpu_grads, cpu_found), (cuda_grads, cuda_found) = run_unscale(grads, 0.25)
        found, total = run_check(grads[:1200], CUDA, 0.25)
        again = run_check(grads[:1200], CUDA, 0.25)[1]
    finally:
        fusedamp._C.set_cuda_launch_settings(**previous)
    assert cpu_found.item() == cuda_found.item() == 1.0 and found.item() == 0.0
    for actual, expected in zip(cuda_grads, cpu_grads, strict=True):
        assert_same(actual.cpu(), expected)
    assert torch.equal(bits(total.cpu()), bits(again.cpu()))
    assert total.item() == pytest.approx(run_check(grads[:1200], "cpu", 0.25)[1].item(), rel=1e-5)


# --- grad_stats ---------------------------------------------------------------------------


@pytest.mark.parametrize("inv_scale", [None, 2.0**-12])
def test_grad_stats_matches_cpu_over_many_launches(inv_scale: float | None) -> None:
    """Mixed dtypes, empty tensors, misaligned views and more tensors than one launch's
    parameters hold: counts and max_abs equal the CPU backend's."""
    generator = torch.Generator().manual_seed(15)
    sizes = torch.randint(0, 300, (400,), generator=generator).tolist() + [65537, 0, 131072]
    dtypes = [FLOAT_DTYPES[i % 3] for i in range(len(sizes))]
    grads = [g * 10.0 ** -(i % 9) for i, g in enumerate(grads_of(dtypes, sizes, seed=16, offset=1))]
    grads[400][65536] = math.inf
    grads[402][0] = math.nan
    cpu_scale = None if inv_scale is None else torch.tensor(inv_scale)
    expected_counts, expected_max_abs = torch.ops.fusedamp.grad_stats(grads, cpu_scale)
    counts, max_abs = torch.ops.fusedamp.grad_stats(
        to_device(grads, CUDA, offset=1), None if cpu_scale is None else cpu_scale.cuda()
    )
    assert torch.equal(counts.cpu(), expected_counts)
    assert torch.equal(max_abs.cpu(), expected_max_abs)
    assert expected_counts[:, 1].sum() > 0 and expected_counts[:, 2].sum() == 2


# --- optimizers ---------------------------------------------------------------------------

# (param dtype, grad dtype, masters): every master kind, and grads of another dtype than params.
OPTIMIZER_CONFIGS = [
    (torch.float32, torch.float32, None),
    (torch.float16, torch.float16, None),
    (torch.float16, torch.float16, "fp32"),
    (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, "fp32"),
    (torch.bfloat16, torch.bfloat16, "remainder"),
    (torch.bfloat16, torch.float32, "fp32"),
    (torch.float32, torch.bfloat16, None),
]


def optimizer_tensors(config: tuple, sizes: list[int], n_states: int, seed: int) -> dict[str, list]:
    """CPU tensors for one optimizer call: params, grads, masters, `n_states` fp32 states, steps."""
    param_dtype, grad_dtype, master = config
    generator = torch.Generator().manual_seed(seed)
    masters_fp32 = [randn(size, torch.float32, generator) for size in sizes]
    params = [m.to(param_dtype) for m in masters_fp32]
    if master == "fp32":
        masters = masters_fp32
    elif master == "remainder":
        masters = [
            torch.randint(-(2**15), 2**15, (size,), generator=generator, dtype=torch.int16) for size in sizes
        ]
    else:
        masters = []
    return {
        "params": params,
        "grads": [randn(size, grad_dtype, generator) for size in sizes],
        "masters": masters,
        "states": [[randn(size, torch.float32, generator).abs() for size in sizes] for _ in range(n_states)],
        "steps": [torch.tensor(float(i % 4)) for i in range(len(sizes))],
    }


def copy_tensors(tensors: dict[str, list], device: str, offset: int = 0) -> dict[str, list]:
    return {
        key: [to_device(v, device, offset) for v in value]
        if key == "states"
        else to_device(value, device, offset)
        for key, value in tensors.items()
    }


def flat_tensors(tensors: dict[str, list]) -> list[torch.Tensor]:
    return [t for key, value in tensors.items() for t in (sum(value, []) if key == "states" else value)]


def assert_optimizer_results_match(cuda: dict[str, list], cpu: dict[str, list], master: str | None) -> None:
    for key in ("params", "masters"):
        for u, c in zip(cuda[key], cpu[key], strict=True):
            if key == "masters" and master == "remainder":
                continue
            assert_close(u, c)
    if master == "remainder":
        for up, ur, cp, cr in zip(
            cuda["params"], cuda["masters"], cpu["params"], cpu["masters"], strict=True
        ):
            assert_close(master_value(up, ur), master_value(cp, cr))
    if master == "fp32":
        # The param is always its master rounded to nearest even.
        for p, m in zip(cuda["params"], cuda["masters"], strict=True):
            assert torch.equal(bits(p.cpu()), bits(m.cpu().to(p.dtype)))
    for u_list, c_list in zip(cuda["states"], cpu["states"], strict=True):
        for u, c in zip(u_list, c_list, strict=True):
            assert_close(u, c)
    for key in ("grads", "steps"):
        for u, c in zip(cuda[key], cpu[key], strict=True):
            assert_same(u, c)


def scalar_inputs(
    device: str, lr_value: float, lr_kind: str, inv: float | None, clip: float | None, found: float | None
):
    lr: float | torch.Tensor = lr_value
    if lr_kind == "cuda":
        lr = torch.tensor(lr_value, device=device)
    elif lr_kind == "cpu":
        lr = torch.tensor(lr_value)

    def optional(value: float | None) -> torch.Tensor | None:
        return None if value is None else torch.tensor(value, device=device)

    return lr, optional(inv), optional(clip), optional(found)


def run_adamw(
    tensors: dict[str, list],
    device: str,
    *,
    amsgrad: bool = False,
    maximize: bool = False,
    lr: float = 1e-2,
    betas: tuple[float, float] = (0.8, 0.95),
    eps: float = 1e-6,
    lr_kind: str = "float",
    inv: float | None = None,
    clip: float | None = None,
    found: float | None = None,
    write: bool = True,
    weight_decay: float = 0.1,
    offset: int = 0,
    steps: int = 1,
) -> dict[str, list]:
    t = copy_tensors(tensors, device, offset)
    lr_arg, inv_t, clip_t, found_t = scalar_inputs(device, lr, lr_kind, inv, clip, found)
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs = t["states"]
    for _ in range(steps):
        ops.adamw_(
            t["params"],
            t["grads"],
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs if amsgrad else [],
            t["masters"],
            t["steps"],
            lr=lr_arg,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            inv_grad_scale=inv_t,
            found_inf=found_t,
            clip_coef=clip_t,
            write_unscaled_grads=write,
        )
    return t


def run_sgd(
    tensors: dict[str, list],
    device: str,
    *,
    momentum: float = 0.9,
    dampening: float = 0.1,
    nesterov: bool = False,
    maximize: bool = False,
    lr: float = 1e-2,
    lr_kind: str = "float",
    inv: float | None = None,
    clip: float | None = None,
    found: float | None = None,
    write: bool = True,
    weight_decay: float = 0.01,
    offset: int = 0,
    steps: int = 1,
) -> dict[str, list]:
    t = copy_tensors(tensors, device, offset)
    lr_arg, inv_t, clip_t, found_t = scalar_inputs(device, lr, lr_kind, inv, clip, found)
    buffers = t["states"][0] if momentum != 0.0 else []
    for _ in range(steps):
        ops.sgd_(
            t["params"],
            t["grads"],
            buffers,
            t["masters"],
            t["steps"],
            lr=lr_arg,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            inv_grad_scale=inv_t,
            found_inf=found_t,
            clip_coef=clip_t,
            write_unscaled_grads=write,
        )
    return t


OptimizerRun = Callable[..., dict[str, list]]
OPTIMIZERS: dict[str, tuple[OptimizerRun, int]] = {"adamw": (run_adamw, 3), "sgd": (run_sgd, 1)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", OPTIMIZER_CONFIGS)
def test_optimizer_matches_cpu(optimizer: str, config: tuple) -> None:
    run, n_states = OPTIMIZERS[optimizer]
    tensors = optimizer_tensors(config, SIZES_WITH_EMPTY, n_states, seed=6)
    kwargs = {"inv": 2.0**-3, "clip": 0.7, "steps": 3}
    assert_optimizer_results_match(run(tensors, CUDA, **kwargs), run(tensors, "cpu", **kwargs), config[2])


ADAMW_OPTIONS = [
    {"amsgrad": True},
    {"maximize": True},
    {"weight_decay": 0.0},
    {"lr_kind": "cuda"},
    {"lr_kind": "cpu"},
    {"inv": 0.5},
    {"clip": 0.25},
    {"inv": 0.5, "clip": 0.25, "write": False},
    {"found": 0.0, "inv": 0.125},
    {"offset": 1, "amsgrad": True, "inv": 0.5},
]
SGD_OPTIONS = [
    {"momentum": 0.0},
    {"nesterov": True, "dampening": 0.0},
    {"maximize": True},
    {"weight_decay": 0.0},
    {"lr_kind": "cuda"},
    {"lr_kind": "cpu"},
    {"inv": 0.5, "clip": 0.25},
    {"inv": 0.5, "write": False},
    {"found": 0.0, "clip": 0.5},
    {"offset": 1, "inv": 0.5},
]


@pytest.mark.parametrize("options", ADAMW_OPTIONS, ids=str)
@pytest.mark.parametrize("config", [OPTIMIZER_CONFIGS[0], OPTIMIZER_CONFIGS[2], OPTIMIZER_CONFIGS[5]])
def test_adamw_options_match_cpu(config: tuple, options: dict) -> None:
    tensors = optimizer_tensors(config, SIZES_WITH_EMPTY, 3, seed=7)
    kwargs = {"steps": 2, **options}
    assert_optimizer_results_match(
        run_adamw(tensors, CUDA, **kwargs), run_adamw(tensors, "cpu", **kwargs), config[2]
    )


@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
@pytest.mark.parametrize("config", [OPTIMIZER_CONFIGS[0], OPTIMIZER_CONFIGS[2], OPTIMIZER_CONFIGS[5]])
def test_sgd_options_match_cpu(config: tuple, options: dict) -> None:
    tensors = optimizer_tensors(config, SIZES_WITH_EMPTY, 1, seed=8)
    kwargs = {"steps": 2, **options}
    assert_optimizer_results_match(
        run_sgd(tensors, CUDA, **kwargs), run_sgd(tensors, "cpu", **kwargs), config[2]
    )


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_many_tiny_tensors(optimizer: str) -> None:
    run, n_states = OPTIMIZERS[optimizer]
    sizes = torch.randint(0, 21, (1000,), generator=torch.Generator().manual_seed(9)).tolist()
    tensors = optimizer_tensors(OPTIMIZER_CONFIGS[4], sizes, n_states, seed=10)
    assert_optimizer_results_match(run(tensors, CUDA, inv=0.5), run(tensors, "cpu", inv=0.5), "fp32")


@pytest.mark.parametrize("settings", LAUNCH_SETTINGS, ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_matches_cpu_under_every_launch_setting(optimizer: str, settings: dict) -> None:
    """Chunk size and kernel parameter budget change how the work is cut into blocks and launches,
    never an element's result: 1000 tensors (several 4 KB launches) and a few long ones."""
    run, n_states = OPTIMIZERS[optimizer]
    generator = torch.Generator().manual_seed(21)
    sizes = torch.randint(0, 300, (1000,), generator=generator).tolist() + [300_001, 70_000]
    for config in (OPTIMIZER_CONFIGS[0], OPTIMIZER_CONFIGS[5]):
        tensors = optimizer_tensors(config, sizes, n_states, seed=22)
        expected = run(tensors, "cpu", inv=0.5, clip=0.7, steps=2)
        previous = fusedamp._C.set_cuda_launch_settings(**settings)
        try:
            actual = run(tensors, CUDA, inv=0.5, clip=0.7, steps=2)
        finally:
            fusedamp._C.set_cuda_launch_settings(**previous)
        assert_optimizer_results_match(actual, expected, config[2])


@pytest.mark.large
def test_adamw_tensor_larger_than_2_pow_31_elements() -> None:
    # fp16 params with fp32 masters, 16 bytes an element. The math does not depend on where an
    # element is, so the big tensor's elements must equal those of a 3-element call on the same
    # values: the first, the one before 2^31 (the last of chunk 2^15 - 1) and the last.
    numel = 2**31 + 1000
    if torch.cuda.mem_get_info()[0] < 48 * 2**30:
        pytest.skip("needs 48 GB of free GPU memory")
    values = {"master": (0.75, -2.0, 4.0), "grad": (0.5, 3.0, -1.5), "exp_avg": (0.1, -0.3, 0.2)}
    where = torch.tensor([0, 2**31 - 1, numel - 1], device=CUDA)

    def make(size: int) -> dict[str, torch.Tensor]:
        t = {}
        for name, (base, before_2_31, last) in values.items():
            t[name] = torch.full((size,), base, device=CUDA)
            t[name][-1] = last
            if size > 3:
                t[name][2**31 - 1] = before_2_31
            else:
                t[name][1] = before_2_31
        t["grad"] = t["grad"].half()
        t["param"] = t["master"].half()
        t["exp_avg_sq"] = t["exp_avg"].square()
        return t

    def step(t: dict[str, torch.Tensor]) -> None:
        ops.adamw_(
            [t["param"]],
            [t["grad"]],
            [t["exp_avg"]],
            [t["exp_avg_sq"]],
            [],
            [t["master"]],
            [torch.tensor(2.0, device=CUDA)],
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            inv_grad_scale=torch.tensor(0.5, device=CUDA),
        )

    small = make(3)
    step(small)
    big = make(numel)
    step(big)
    for name in ("param", "master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(bits(big[name][where]), bits(small[name])), name
        first = big[name][0]
        assert torch.all(big[name][1:1000] == first) and torch.all(
            big[name][2**31 - 1000 : 2**31 - 1] == first
        )
        assert torch.all(big[name][2**31 : numel - 1] == first), name


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", OPTIMIZER_CONFIGS)
@pytest.mark.parametrize("found", [1.0, 2.0])
def test_optimizer_skips_step_on_found_inf(optimizer: str, config: tuple, found: float) -> None:
    run, n_states = OPTIMIZERS[optimizer]
    tensors = optimizer_tensors(config, SIZES_WITH_EMPTY, n_states, seed=11)
    options = {"found": found, "inv": 0.5, "clip": 0.5, **({"amsgrad": True} if optimizer == "adamw" else {})}
    assert_bits_unchanged(flat_tensors(run(tensors, CUDA, **options)), flat_tensors(tensors))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_grad_skips_the_fused_step(bad: float) -> None:
    tensors = optimizer_tensors(OPTIMIZER_CONFIGS[4], SIZES_WITH_EMPTY, 3, seed=12)
    tensors["grads"][5][65536] = bad
    t = copy_tensors(tensors, CUDA)
    before = flat_tensors(copy_tensors(t, "cpu"))
    found_inf = torch.zeros((), device=CUDA)
    inv = torch.tensor(2.0**-4, device=CUDA)
    ops.check_and_norm_(t["grads"], found_inf, None, inv)
    exp_avgs, exp_avg_sqs, _ = t["states"]
    ops.adamw_(
        t["params"],
        t["grads"],
        exp_avgs,
        exp_avg_sqs,
        [],
        t["masters"],
        t["steps"],
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        inv_grad_scale=inv,
        found_inf=found_inf,
    )
    assert found_inf.item() == 1.0
    assert_bits_unchanged(flat_tensors(t), before)


# --- optimizers, bitwise against CPU -----------------------------------------------------------
# With hyperparameters that are powers of two (betas 0.5, lr 2^-6, ...) and grads of at most 8
# significant bits, every product in the update is exact: whether a compiler fuses a * b + c
# into an FMA no longer changes the result, and the remaining operations (sums, sqrt, division,
# rounding to the param's dtype) are correctly rounded on both backends. So CUDA must match the
# CPU bit for bit, NaN payloads aside (x86 makes 0xFFC00000, a GPU 0x7FFFFFFF): a NaN must be a
# NaN on both, in every master mode (remainder included).

EXACT_ADAMW = {"lr": 2.0**-6, "betas": (0.5, 0.5), "eps": 2.0**-20, "weight_decay": 0.25}
EXACT_SGD = {"lr": 2.0**-6, "momentum": 0.5, "dampening": 0.0, "weight_decay": 0.25}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same bits, except that a NaN only has to be a NaN in both."""
    actual, expected = actual.cpu(), expected.cpu()
    if not expected.is_floating_point():
        assert torch.equal(actual, expected)
        return
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    assert torch.equal(bits(actual)[~nan], bits(expected)[~nan])


def assert_optimizer_results_bitwise(cuda: dict[str, list], cpu: dict[str, list], master: str | None) -> None:
    for key in ("params", "grads", "steps"):
        for u, c in zip(cuda[key], cpu[key], strict=True):
            assert_bitwise(u, c)
    for u_list, c_list in zip(cuda["states"], cpu["states"], strict=True):
        for u, c in zip(u_list, c_list, strict=True):
            assert_bitwise(u, c)
    if master is None:
        return
    for up, um, cp, cm in zip(cuda["params"], cuda["masters"], cpu["params"], cpu["masters"], strict=True):
        if master == "remainder":
            # The fp32 master the pair encodes; a NaN master's remainder bits depend on its payload.
            assert_bitwise(master_value(up, um), master_value(cp, cm))
        else:
            assert_bitwise(um, cm)


def exact_tensors(config: tuple, n_states: int, seed: int) -> dict[str, list]:
    """optimizer_tensors with grads of 8 significant bits (their squares are exact in fp32)."""
    tensors = optimizer_tensors(config, SIZES_WITH_EMPTY, n_states, seed)
    tensors["grads"] = [g.to(torch.bfloat16).to(g.dtype) for g in tensors["grads"]]
    return tensors


def run_exact(optimizer: str, tensors: dict[str, list], device: str, **options) -> dict[str, list]:
    if optimizer == "adamw":
        return run_adamw(tensors, device, **{**EXACT_ADAMW, **options})
    return run_sgd(tensors, device, **{**EXACT_SGD, **options})


EXACT_OPTIONS = {
    "adamw": [{}, {"amsgrad": True, "maximize": True}, {"clip": 0.5, "write": False}],
    "sgd": [{"dampening": 0.5}, {"nesterov": True, "maximize": True}, {"momentum": 0.0, "clip": 0.5}],
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", OPTIMIZER_CONFIGS)
@pytest.mark.parametrize("variant", range(3))
def test_optimizer_bitwise_matches_cpu(optimizer: str, config: tuple, variant: int) -> None:
    tensors = exact_tensors(config, OPTIMIZERS[optimizer][1], seed=20 + variant)
    options = {"inv": 2.0**-3, "steps": 3, **EXACT_OPTIONS[optimizer][variant]}
    cuda = run_exact(optimizer, tensors, CUDA, **options)
    assert_optimizer_results_bitwise(cuda, run_exact(optimizer, tensors, "cpu", **options), config[2])
    # Not vacuous: the step did move the params.
    assert not torch.equal(bits(cuda["params"][5].cpu()), bits(tensors["params"][5]))


def poison_grads(tensors: dict[str, list]) -> None:
    """inf, -inf and NaN grads in a few places, first and last elements of chunks included."""
    where = [(5, 0, math.inf), (5, 65536, -math.inf), (5, 4097, math.nan), (1, 0, math.nan), (4, 3, math.inf)]
    for tensor, index, value in where:
        tensors["grads"][tensor][index] = value


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("config", OPTIMIZER_CONFIGS)
@pytest.mark.parametrize("cause", ["non-finite grads", "huge lr"])
def test_non_finite_updates_without_found_inf_match_cpu(optimizer: str, config: tuple, cause: str) -> None:
    """Without found_inf nothing skips the step: infs and NaNs flow into the params and states as
    on the CPU (and in torch), in every master mode. A NaN master stays a NaN param (a bf16
    remainder split of the GPU's NaN 0x7FFFFFFF must not wrap to -0.0)."""
    tensors = exact_tensors(config, OPTIMIZERS[optimizer][1], seed=30)
    options: dict = {"inv": 2.0**-3, "steps": 2}
    if cause == "non-finite grads":
        poison_grads(tensors)
    else:
        options["lr"] = 2.0**120  # lr * update overflows float32
    cuda = run_exact(optimizer, tensors, CUDA, **options)
    cpu = run_exact(optimizer, tensors, "cpu", **options)
    assert_optimizer_results_bitwise(cuda, cpu, config[2])
    updated = cuda["params"][5].cpu().float()
    assert not updated.isfinite().all()
    if cause == "non-finite grads" and optimizer == "adamw":
        # inf / inf in the update: these params must be NaN, not a finite value or a zero.
        assert updated[[0, 4097, 65536]].isnan().all()

"""The CUDA gemm kernels against a float64 reference (skipped without a GPU; run by
tools/gpu_check.sh): every backend, shape, layout, dtype and epilogue."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from op_table import ACTIVATIONS

import fusedamp.nn
from fusedamp import _C, ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZES = [1, 7, 8, 63, 64, 65, 127, 129, 1000, 4096]


def backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    major, minor = torch.cuda.get_device_capability()
    names = ["reference"] + (["mma_sync", "auto"] if major >= 8 else [])
    # wgmma picks its schedule by shape (small outputs ping-pong); the forced ping-pong runs the
    # large ones too.
    return names + (["wgmma", "wgmma_pingpong"] if (major, minor) == (9, 0) else [])


@pytest.fixture(params=backends())
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    previous = _C.set_gemm_backend(request.param)
    yield request.param
    _C.set_gemm_backend(previous)


def make(m: int, n: int, k: int, dtype: torch.dtype, a_t: bool, b_t: bool, integer: bool):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)

    def rand(*shape: int) -> torch.Tensor:
        if integer:
            return torch.randint(-3, 4, shape, device="cuda", generator=g).to(dtype)
        return torch.randn(shape, device="cuda", generator=g).to(dtype)

    a = rand(k, m).t() if a_t else rand(m, k)
    b = rand(n, k).t() if b_t else rand(k, n)
    return a, b, rand(n)


def poison_allocator() -> None:
    """Fills freed cache blocks with NaN so an output element the kernel skips shows up."""
    torch.cuda.synchronize()
    junk = torch.full((64 << 20,), float("nan"), device="cuda", dtype=torch.float16)
    del junk


# Sizes for M, N, K sampled to keep the run in minutes: every size appears in every position.
SHAPES = sorted(
    {(m, n, k) for m, n, k in zip(SIZES, SIZES[3:] + SIZES[:3], SIZES[6:] + SIZES[:6], strict=True)}
    | {(s, s, s) for s in SIZES if s <= 1000}
    | {(4096, 4096, 4096)}
)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
def test_error_no_worse_than_twice_torch(backend, m, n, k, dtype, a_t, b_t):
    a, b, bias = make(m, n, k, dtype, a_t, b_t, integer=False)
    for activation in ACTIVATIONS:
        poison_allocator()
        out, preact = ops.gemm_with_preactivation(a, b, bias, activation)
        ref_z = a.double() @ b.double() + bias.double()
        ref = ACTIVATIONS[activation](ref_z)
        theirs = ACTIVATIONS[activation](torch.matmul(a, b) + bias)
        assert not out.isnan().any() and not preact.isnan().any()
        ours_err = (out.double() - ref).abs().max().item()
        torch_err = (theirs.double() - ref).abs().max().item()
        ulp = torch.finfo(dtype).eps * ref.abs().max().item()
        assert ours_err <= 2 * torch_err + ulp, (activation, ours_err, torch_err)
        assert (preact.double() - ref_z).abs().max().item() <= 2 * torch_err + ulp


@pytest.mark.parametrize("m,n,k", [(65, 129, 63), (1000, 4096, 127), (4096, 1000, 1000)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("a_t,b_t", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_integer_inputs_are_bitwise_exact(backend, m, n, k, dtype, a_t, b_t, out_dtype):
    a, b, bias = make(m, n, k, dtype, a_t, b_t, integer=True)
    poison_allocator()
    out = ops.gemm(a, b, bias, out_dtype=out_dtype)
    expected = (a.double() @ b.double() + bias.double()).to(out.dtype)
    assert torch.equal(out, expected)


def test_linear_gelu_forward_backward_on_gpu(backend):
    torch.manual_seed(0)
    layer = fusedamp.nn.Linear(1024, 4096, activation="gelu", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    x32 = x.detach().float().requires_grad_()
    w32 = layer.weight.detach().float().requires_grad_()
    y32 = F.gelu(F.linear(x32, w32, layer.bias.detach().float()))
    torch.testing.assert_close(y.float(), y32, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(y)
    y.backward(grad)
    y32.backward(grad.float())
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(layer.weight.grad.float(), w32.grad, rtol=5e-2, atol=5e-1)


def test_routing_on_cuda_under_autocast(backend):
    layer = torch.nn.Linear(256, 128, device="cuda")
    x = torch.randn(64, 256, device="cuda")
    with fusedamp.nn.fused_gemm_routing(), torch.autocast("cuda", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), layer(x), rtol=2e-2, atol=2e-2)


def test_cpu_and_cuda_agree(backend):
    a, b, bias = make(129, 65, 127, torch.bfloat16, False, True, integer=False)
    cpu = ops.gemm(a.cpu(), b.cpu(), bias.cpu(), "gelu", torch.float32)
    cuda = ops.gemm(a, b, bias, "gelu", torch.float32)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-4)


# --- each kernel forced, against float64 with an error bound from K and the dtypes ---------------


@pytest.fixture(params=["mma_sync", "wgmma_cooperative", "wgmma_pingpong"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend forced to one kernel family (and wgmma schedule), where the GPU and this build
    can run it."""
    name = request.param
    family = name.split("_")[0] if name.startswith("wgmma") else name
    capability = torch.cuda.get_device_capability()
    if family not in fusedamp.build_info()["gemm_kernels"]:
        pytest.skip(f"this build has no {family} code")
    if capability < (8, 0) or (family == "wgmma" and capability != (9, 0)):
        pytest.skip(f"the {name} kernel does not run on sm_{capability[0]}{capability[1]}")
    previous = _C.set_gemm_backend(name)
    yield name
    _C.set_gemm_backend(previous)


def operand(rows: int, cols: int, unit: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A (rows, cols) view cut out of a larger buffer: unit stride along "cols" (leading dim a
    multiple of 8 past cols, as buf[:, :k]) or along "rows" (a transposed such view)."""

    def pad(n: int) -> int:
        return (n + 7) // 8 * 8 + 8

    if unit == "cols":
        return torch.randn(rows + 3, pad(cols), device="cuda", generator=g).to(dtype)[:rows, :cols]
    return torch.randn(cols + 3, pad(rows), device="cuda", generator=g).to(dtype)[:cols, :rows].t()


def assert_within_float64_bound(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """|out - exact| <= 2 (K + 2) eps32 (|A| |B| + |bias|) + eps_out |exact|: the fp32 accumulation of
    K exact products (an fp32 ulp per addition, twice over for Tensor Cores that truncate), the
    bias addition, then one rounding to out's dtype. A lost or doubled product, an element read
    from the wrong place or an output never written (NaN) exceeds it."""
    a2 = a.reshape(-1, a.shape[-1]).double()
    exact = a2 @ b.double()
    magnitude = a2.abs() @ b.double().abs()
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    k = a.shape[-1]
    out_info = torch.finfo(out.dtype)
    bound = (
        2 * (k + 2) * torch.finfo(torch.float32).eps * magnitude
        + out_info.eps * exact.abs()
        + out_info.tiny * out_info.eps
    )
    error = (out.reshape(exact.shape).double() - exact).abs()
    assert out.shape == (*a.shape[:-1], b.shape[1])
    worst = (error / bound).nan_to_num(1e9).max().item()
    assert bool((error <= bound).all()), f"worst error / bound: {worst}"


@pytest.mark.parametrize("k", [1, 7, 65, 1001])
@pytest.mark.parametrize("a_unit,b_unit", list(itertools.product(["cols", "rows"], repeat=2)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_k_tails_and_sliced_views(kernel, k, a_unit, b_unit, dtype):
    """K from 1 to past a tile, operands sliced out of wider buffers (buf[:, :k] for A, and for
    B = W.t() as in nn.Linear) or transposed, so that leading dims exceed the extents."""
    g = torch.Generator(device="cuda").manual_seed(k)
    a = operand(200, k, a_unit, dtype, g)
    b = operand(k, 264, b_unit, dtype, g)
    bias = torch.randn(264, device="cuda", generator=g)
    poison_allocator()
    assert_within_float64_bound(ops.gemm(a, b, bias), a, b, bias)


@pytest.mark.parametrize("misalignment", ["storage_offset", "leading_dim"])
@pytest.mark.parametrize("operand_name", ["a", "b"])
def test_misaligned_operands_take_the_reference_path(kernel, misalignment, operand_name):
    """cp.async and TMA need 16-byte aligned rows: a view one element into its storage, or with a
    leading dim that is not a multiple of 8, must run the ATen reference (same bits)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    m, n, k = 136, 264, 64
    a = torch.randn(m, k, device="cuda", generator=g).half()
    b = torch.randn(k, n, device="cuda", generator=g).half()
    source = a if operand_name == "a" else b
    rows, cols = source.shape
    if misalignment == "storage_offset":
        view = torch.empty(rows * cols + 1, device="cuda", dtype=source.dtype)[1:].view(rows, cols)
    else:
        view = torch.empty(rows, cols + 1, device="cuda", dtype=source.dtype)[:, :cols]
    view.copy_(source)
    a, b = (view, b) if operand_name == "a" else (a, view)
    out = ops.gemm(a, b)
    previous = _C.set_gemm_backend("reference")
    try:
        expected = ops.gemm(a, b)
    finally:
        _C.set_gemm_backend(previous)
    assert torch.equal(out, expected)
    assert_within_float64_bound(out, a, b, None)


@pytest.mark.parametrize("bias_dtype", [None, "input", torch.float32])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tails_in_every_dim_and_more_tiles_than_sms(kernel, bias_dtype, out_dtype, dtype):
    """2000 x 3000 x 1000: M, N and K tails in every tile size, several tiles per SM (the
    persistent wgmma grid walks more than one), bias absent, in the input type or fp32."""
    g = torch.Generator(device="cuda").manual_seed(4)
    m, n, k = 2000, 3000, 1000
    a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, k, device="cuda", generator=g).to(dtype).t()
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(n, device="cuda", generator=g).to(dtype if bias_dtype == "input" else bias_dtype)
    poison_allocator()
    out = ops.gemm(a, b, bias, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or dtype)
    assert_within_float64_bound(out, a, b, bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_3d_input(kernel, dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(4, 50, 136, device="cuda", generator=g).to(dtype)
    b = torch.randn(136, 264, device="cuda", generator=g).to(dtype)
    bias = torch.randn(264, device="cuda", generator=g)
    poison_allocator()
    assert_within_float64_bound(ops.gemm(a, b, bias), a, b, bias)


def test_gpus_below_sm80_run_the_reference_without_a_warning():
    # A Turing GPU (T4): the mma.sync kernel's sm_75 code is an empty body, so `auto` must take the
    # reference (silently: nothing to rebuild) and the forced kernels must refuse.
    capability = torch.cuda.get_device_capability()
    if capability >= (8, 0):
        pytest.skip(f"sm_{capability[0]}{capability[1]} runs the GEMM kernels")
    a, b, bias = make(129, 65, 127, torch.float16, False, True, integer=True)
    previous = _C.set_gemm_backend("auto")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = ops.gemm(a, b, bias, "relu", torch.float32)
        expected = F.relu(a.double() @ b.double() + bias.double()).float()
        assert torch.equal(out, expected)
        for name in ("mma_sync", "wgmma"):
            _C.set_gemm_backend(name)
            with pytest.raises(RuntimeError, match="sm_80 or newer|sm_90 GPU"):
                ops.gemm(a, b)
    finally:
        _C.set_gemm_backend(previous)

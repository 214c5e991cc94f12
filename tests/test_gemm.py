"""fusedamp.ops.gemm on CPU beyond tests/op_table.py (which holds its float64, opcheck and
bad-input tests): exact integer products and autograd; fusedamp.nn.Linear against nn.Linear, and
the F.linear / matmul routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_table import ACTIVATIONS

import fusedamp.nn
from fusedamp import ops
from fusedamp.nn import routing

HALF = [torch.float16, torch.bfloat16]


def operands(m: int, n: int, k: int, dtype: torch.dtype, a_t: bool, b_t: bool, seed: int = 0):
    """a (m, k) and b (k, n) in dtype; a_t / b_t make them transposed views of contiguous
    tensors (the dY^T . X and x . W^T layouts)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, m, generator=g).to(dtype).t() if a_t else torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype).t() if b_t else torch.randn(k, n, generator=g).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", HALF)
def test_integer_inputs_are_exact(dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-4, 5, (33, 70), generator=g).to(dtype)
    b = torch.randint(-4, 5, (70, 21), generator=g).to(dtype)
    bias = torch.randint(-8, 9, (21,), generator=g).to(dtype)
    out = ops.gemm(a, b, bias, out_dtype=torch.float32)
    assert torch.equal(out, (a.double() @ b.double() + bias.double()).float())


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("a_t", [False, True])
def test_autograd_matches_float32_composite(activation, keep, a_t):
    a0, b0 = operands(12, 10, 9, torch.float16, a_t, True, seed=5)
    bias0 = torch.randn(10)
    a, b, bias = (t.detach().clone().requires_grad_() for t in (a0, b0, bias0))
    out, preact = torch.ops.fusedamp.gemm(a, b, bias, activation, None, keep)
    grad = torch.randn(out.shape).half()
    out.backward(grad)

    a32, b32, bias32 = (t.detach().float().requires_grad_() for t in (a0, b0, bias0))
    ACTIVATIONS[activation](a32 @ b32 + bias32).backward(grad.float())
    for got, want in ((a.grad, a32.grad), (b.grad, b32.grad), (bias.grad, bias32.grad)):
        assert got.dtype == want.dtype if got is bias.grad else got.dtype == torch.float16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_preactivation_gradient_flows():
    a, b = (t.requires_grad_() for t in operands(4, 3, 5, torch.bfloat16, False, False))
    out, preact = ops.gemm_with_preactivation(a, b, None, "relu")
    preact.sum().backward()
    torch.testing.assert_close(
        a.grad.float(), torch.ones(4, 3) @ b.detach().float().t(), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_nn_linear(dtype, activation, bias):
    torch.manual_seed(0)
    ours = fusedamp.nn.Linear(24, 16, bias=bias, activation=activation)
    theirs = torch.nn.Linear(24, 16, bias=bias)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 24)
    x1 = x.to(dtype).requires_grad_()
    x2 = x.to(dtype).float().requires_grad_()
    y1 = ours.to(dtype)(x1)
    y2 = ACTIVATIONS[activation](theirs(x2))
    assert y1.dtype == dtype and y1.shape == (3, 5, 16)
    torch.testing.assert_close(y1.float(), y2, rtol=2e-2, atol=2e-2)
    grad = torch.randn(y1.shape)
    y1.backward(grad.to(dtype))
    y2.backward(grad.to(dtype).float())
    torch.testing.assert_close(x1.grad.float(), x2.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(ours.weight.grad.float(), theirs.weight.grad, rtol=3e-2, atol=5e-2)
    if bias:
        torch.testing.assert_close(ours.bias.grad.float(), theirs.bias.grad, rtol=3e-2, atol=5e-2)


def test_linear_in_float32_is_nn_linear():
    ours = fusedamp.nn.Linear(8, 4, activation="gelu")
    x = torch.randn(5, 8)
    assert torch.equal(ours(x), F.gelu(F.linear(x, ours.weight, ours.bias)))
    assert "activation=gelu" in repr(ours)
    with pytest.raises(ValueError, match="activation"):
        fusedamp.nn.Linear(8, 4, activation="swish")


def test_linear_under_cpu_autocast_computes_in_bf16():
    ours = fusedamp.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, ours.weight, ours.bias), rtol=2e-2, atol=2e-2)


@pytest.fixture
def gemm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Records the shape of every a operand that reaches fusedamp.ops.gemm."""
    calls: list[tuple[int, ...]] = []
    real = ops.gemm

    def spy(a, b, *args, **kwargs):
        calls.append(tuple(a.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(ops, "gemm", spy)
    return calls


def test_routing_takes_half_linear_and_matmul(gemm_calls):
    x = torch.randn(2, 6, 8).half()
    w = torch.randn(4, 8).half()
    bias = torch.randn(4).half()
    with fusedamp.nn.fused_gemm_routing(device_types=("cpu",)):
        y = F.linear(x, w, bias)
        z = torch.matmul(x, w.t())
        z2 = x @ w.t()
        z3 = x.matmul(w.t())
    assert gemm_calls == [(2, 6, 8)] * 4
    torch.testing.assert_close(y, ops.gemm(x, w.t(), bias))
    for out in (z, z2, z3):
        torch.testing.assert_close(out, ops.gemm(x, w.t()))


def test_routing_leaves_other_calls_to_torch(gemm_calls):
    a32 = torch.randn(4, 8)
    b32 = torch.randn(8, 3)
    batched = torch.randn(2, 8, 3).half()
    with fusedamp.nn.fused_gemm_routing(device_types=("cpu",)):
        y = torch.matmul(a32, b32)
        torch.matmul(a32.half(), batched)
        torch.matmul(a32[0].half(), b32.half())
    with fusedamp.nn.fused_gemm_routing():
        torch.matmul(a32.half(), b32.half())
    torch.matmul(a32.half(), b32.half())
    assert gemm_calls == []
    assert torch.equal(y, a32 @ b32)


def test_routing_under_autocast_casts_like_autocast(gemm_calls):
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with fusedamp.nn.fused_gemm_routing(device_types=("cpu",)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    assert gemm_calls == [(3, 8)]
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    torch.testing.assert_close(y.float(), layer(x).detach(), rtol=2e-2, atol=2e-2)


def test_routing_leaves_gpus_without_gemm_kernels_to_torch(gemm_calls, monkeypatch):
    # Below sm_80 ops.gemm could only run its fp32 ATen reference: torch's own GEMM is better there.
    for capability, expected in [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert routing._has_gemm_kernels(torch.device("cuda:0")) is expected, capability
    assert routing._has_gemm_kernels(torch.device("cpu"))
    # The routing asks it of every call's device.
    monkeypatch.setattr(routing, "_has_gemm_kernels", lambda device: False)
    x = torch.randn(2, 8).half()
    w = torch.randn(4, 8).half()
    with fusedamp.nn.fused_gemm_routing(device_types=("cpu",)):
        y = F.linear(x, w)
        torch.matmul(x, w.t())
    assert gemm_calls == []
    assert torch.equal(y, F.linear(x, w))

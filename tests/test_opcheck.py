"""torch.library.opcheck on the optimizer ops (schema, fake kernels, dispatch) per device."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def optimizer_lists(device: str, dtype: torch.dtype, master_dtype: torch.dtype | None):
    generator = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (7,), (0,), (129,)]

    def rand(shape: tuple[int, ...], to: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=to)

    params = [rand(s, dtype) for s in shapes]
    grads = [rand(s, dtype) for s in shapes]
    states = [[rand(s, torch.float32).abs() for s in shapes] for _ in range(3)]
    if master_dtype is None:
        masters = []
    elif master_dtype == torch.int16:
        masters = [torch.randint(-100, 100, s, dtype=torch.int16, device=device) for s in shapes]
    else:
        masters = [p.float() for p in params]
    steps = [torch.tensor(float(i), device=device) for i in range(len(shapes))]
    return params, grads, states, masters, steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,master_dtype",
    [(torch.float32, None), (torch.float16, torch.float32), (torch.bfloat16, torch.int16)],
)
def test_adamw_opcheck(device: str, dtype: torch.dtype, master_dtype: torch.dtype | None) -> None:
    params, grads, (m, v, vmax), masters, steps = optimizer_lists(device, dtype, master_dtype)
    scalar = torch.tensor(0.5, device=device)
    args = (
        params,
        grads,
        m,
        v,
        vmax,
        masters,
        steps,
        1e-3,
        None,
        0.9,
        0.999,
        1e-8,
        0.01,
        True,
        False,
        scalar,
        torch.zeros((), device=device),
        scalar.clone(),
        True,
    )
    torch.library.opcheck(torch.ops.fusedamp.adamw_.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_sgd_opcheck(device: str, dtype: torch.dtype, master_dtype: torch.dtype | None) -> None:
    params, grads, (buffers, _, _), masters, steps = optimizer_lists(device, dtype, master_dtype)
    lr = torch.tensor(0.1, device=device)
    args = (
        params,
        grads,
        buffers,
        masters,
        steps,
        0.0,
        lr,
        0.9,
        0.1,
        1e-4,
        True,
        False,
        None,
        None,
        None,
        True,
    )
    torch.library.opcheck(torch.ops.fusedamp.sgd_.default, args)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_bf16_remainder_ops_opcheck(layout: str) -> None:
    master = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(2))
    if layout == "channels_last":
        master = master.to(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.fusedamp.split_bf16_remainder.default, (master,))
    param, remainder = torch.ops.fusedamp.split_bf16_remainder(master)
    assert param.stride() == remainder.stride() == master.stride()
    torch.library.opcheck(torch.ops.fusedamp.join_bf16_remainder.default, (param, remainder))
    assert torch.equal(torch.ops.fusedamp.join_bf16_remainder(param, remainder), master)

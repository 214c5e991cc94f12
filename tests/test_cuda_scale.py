"""Scale on the GPU: zero-element tensors at every slot position of the multi-tensor launcher
(across launch boundaries), and one AdamW step on a tensor of more than 2^31 elements.

The launcher's partitioning itself is tested on the CPU in tests/test_multi_tensor_plan.py;
these run the CUDA kernels on what it plans and compare with the CPU kernels.
"""

from __future__ import annotations

import pytest
import torch

import fusedamp
from fusedamp import ops

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fusedamp.build_info()["cuda_compiled"]),
    reason="needs a CUDA GPU and fusedamp's CUDA kernels",
)

# More than two launches' worth of slots for every op (a launch holds at most 127 tensors).
COUNT = 2 * 127 + 3


def sizes_with_empty(position: int) -> list[int]:
    """COUNT tensor sizes, small and varied, with the one at ``position`` empty."""
    return [0 if index == position else 1 + (index * 37) % 300 for index in range(COUNT)]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """As tests/test_cuda_ops.py allows: a few fp32 ulps (nvcc's FMAs), one ulp of a half dtype
    (rounding a master that differs by an ulp)."""
    tolerance = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[want.dtype]
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tolerance, atol=1e-6)


def adamw_call(sizes: list[int], device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(len(sizes))
    params = [torch.randn(size, generator=generator).to(torch.bfloat16) for size in sizes]
    grads = [torch.randn(size, generator=generator).to(torch.bfloat16) for size in sizes]
    masters = [param.float() for param in params]
    tensors = [params, grads, [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes], masters]
    tensors = [[tensor.to(device) for tensor in group] for group in tensors]
    steps = [torch.zeros((), device=device) for _ in sizes]
    found_inf = torch.zeros((), device=device)
    inv_scale = torch.full((), 0.5, device=device)
    ops.adamw_(
        tensors[0],
        tensors[1],
        tensors[2],
        tensors[3],
        [],
        tensors[4],
        steps,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        inv_grad_scale=inv_scale,
        found_inf=found_inf,
    )
    return [tensor.cpu() for group in tensors for tensor in group] + [step.cpu() for step in steps]


@pytest.mark.parametrize("position", [0, 1, 63, 126, 127, 128, 253, 254, COUNT - 1])
def test_zero_element_tensor_at_slot_positions(position: int) -> None:
    """An empty tensor at the first, last and boundary slots of each launch: the CUDA kernels
    write what the CPU kernels write, and nothing into the empty slot's neighbours' memory."""
    sizes = sizes_with_empty(position)
    for got, want in zip(adamw_call(sizes, "cuda"), adamw_call(sizes, "cpu"), strict=True):
        close(got, want)
    grads = [torch.randn(size) for size in sizes]
    expected = [grad * 0.25 for grad in grads]
    found_inf = torch.zeros((), device="cuda")
    cuda_grads = [grad.cuda() for grad in grads]
    ops.unscale_(cuda_grads, found_inf, torch.full((), 0.25, device="cuda"))
    assert found_inf.item() == 0.0
    for got, want in zip(cuda_grads, expected, strict=True):
        assert torch.equal(got.cpu(), want)


def test_every_slot_position_empty_in_turn() -> None:
    """unscale_ with the empty tensor at each of the COUNT positions in turn."""
    for position in range(COUNT):
        sizes = sizes_with_empty(position)
        grads = [torch.full((size,), float(index + 1), device="cuda") for index, size in enumerate(sizes)]
        found_inf = torch.zeros((), device="cuda")
        ops.unscale_(grads, found_inf, torch.full((), 0.5, device="cuda"))
        for index, grad in enumerate(grads):
            assert grad.numel() == sizes[index]
            assert torch.all(grad == (index + 1) / 2), (position, index)
    assert found_inf.item() == 0.0


def test_adamw_on_more_than_2_pow_31_elements() -> None:
    """One fp16 param of 2^31 + 2^20 elements with an fp32 master (~34 GB with grads and
    moments): the elements past 2^31 are updated exactly as the first ones and as a small tensor
    with the same values is (64-bit indexing everywhere)."""
    numel = 2**31 + 2**20
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    param = torch.ones(numel, dtype=torch.float16, device="cuda")
    grad = torch.full((numel,), 0.5, dtype=torch.float16, device="cuda")
    special = (0, 2**31 - 1, 2**31, numel - 1)
    for index, position in enumerate(special):
        grad[position] = -1.0 - index
    exp_avg = torch.zeros(numel, device="cuda")
    exp_avg_sq = torch.zeros(numel, device="cuda")
    master = torch.ones(numel, device="cuda")
    step = torch.zeros((), device="cuda")
    options = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    ops.adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [master], [step], **options)

    small_grad = torch.tensor([0.5, *(-1.0 - i for i in range(len(special)))], dtype=torch.float16)
    count = len(small_grad)
    small = [
        torch.ones(count, dtype=torch.float16),
        small_grad,
        torch.zeros(count),
        torch.zeros(count),
        torch.ones(count),
    ]
    small = [tensor.cuda() for tensor in small]
    ops.adamw_(
        [small[0]],
        [small[1]],
        [small[2]],
        [small[3]],
        [],
        [small[4]],
        [torch.zeros((), device="cuda")],
        **options,
    )
    windows = (
        slice(1, 4097),
        slice(2**31 - 4097, 2**31 - 1),
        slice(2**31 + 1, 2**31 + 4097),
        slice(numel - 4097, numel - 1),
    )
    for big, reference in zip((param, exp_avg, exp_avg_sq, master), (small[0], *small[2:]), strict=True):
        # An element the kernel missed would still be 0 or 1: every reference value is not.
        assert not ((reference == 0) | (reference == 1)).any()
        close(big[list(special)], reference[1:])
        for window in windows:
            close(big[window], reference[0].expand(window.stop - window.start))
    assert step.item() == 1.0

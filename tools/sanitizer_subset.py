"""A small run of every CUDA kernel family for compute-sanitizer's memcheck and initcheck (run by
gpu_check.sh): one AdamW and one SGD step per param dtype / master mode, the coded-state steps
(bf16 and int8 moments, stochastic bf16 params) through the optimizers, FusedMuon, unscale_,
check_and_norm_ (also of only empty grads, where no block runs), grad_stats, and one gemm per
kernel the GPU and this build can run. Sizes put tails at chunk and tile ends and views one
element into their storage (scalar paths). Without a GPU it says so and exits 0 (skipped).
Run it as a module from the checkout's root, where fusedamp is:

    compute-sanitizer --tool initcheck --error-exitcode 1 python -m tools.sanitizer_subset
"""

from __future__ import annotations

import sys

import torch

import fusedamp
from fusedamp import _C, ops

CUDA = "cuda"
# One element, a partial vector group, one chunk and one more element, and an empty tensor.
SIZES = [1, 7, 65537, 0]
# (param dtype, master): fp32 params have none, fp16 a full fp32 one, bf16 either kind.
CONFIGS = [
    (torch.float32, None),
    (torch.float16, None),
    (torch.float16, "fp32"),
    (torch.bfloat16, None),
    (torch.bfloat16, "fp32"),
    (torch.bfloat16, "remainder"),
]


def tensors(dtype: torch.dtype, offset: int = 0) -> list[torch.Tensor]:
    """One tensor per size, `offset` elements into its own allocation."""
    return [torch.randn(size + offset, device=CUDA).to(dtype)[offset:] for size in SIZES]


def masters(params: list[torch.Tensor], kind: str | None) -> list[torch.Tensor]:
    if kind == "fp32":
        return [p.float() for p in params]
    if kind == "remainder":
        return [torch.zeros(p.shape, dtype=torch.int16, device=CUDA) for p in params]
    return []


def optimizer_steps() -> None:
    for dtype, kind in CONFIGS:
        for offset in (0, 1):
            params = tensors(dtype, offset)
            grads = tensors(dtype, offset)
            states = [[torch.zeros(p.shape, device=CUDA) for p in params] for _ in range(3)]
            steps = [torch.zeros((), device=CUDA) for _ in params]
            scale = torch.tensor(0.5, device=CUDA)
            ops.adamw_(
                params,
                grads,
                states[0],
                states[1],
                states[2],
                masters(params, kind),
                steps,
                lr=torch.tensor(1e-3, device=CUDA),
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                amsgrad=True,
                inv_grad_scale=scale,
                found_inf=torch.zeros((), device=CUDA),
            )
            ops.sgd_(
                params,
                grads,
                states[0],
                masters(params, kind),
                steps,
                lr=1e-2,
                momentum=0.9,
                weight_decay=0.01,
                inv_grad_scale=scale,
            )
            print(f"adamw_ + sgd_: {dtype} params, master {kind}, offset {offset}")


def coded_steps() -> None:
    """FusedAdamW, FusedSGD and FusedMuon with coded states: their codec blocks end at tails."""
    for moments in ("bf16", "int8"):
        for dtype, master in (
            (torch.float32, True),
            (torch.bfloat16, "remainder"),
            (torch.bfloat16, "stochastic"),
        ):
            params = [torch.nn.Parameter(t) for t in tensors(dtype, 1)]
            for param in params:
                param.grad = torch.randn_like(param)
            fusedamp.FusedAdamW(params, moments=moments, master_weights=master, max_grad_norm=1.0).step()
            fusedamp.FusedSGD(params, lr=1e-2, momentum=0.9, moments=moments, master_weights=master).step()
            matrices = [
                torch.nn.Parameter(torch.randn(shape, device=CUDA).to(dtype))
                for shape in ((7, 5), (300, 257))
            ]
            for matrix in matrices:
                matrix.grad = torch.randn_like(matrix)
            fusedamp.FusedMuon(matrices, moments=moments, master_weights=master).step()
            print(f"coded steps: {moments} moments, {dtype} params, master {master}")


def grad_ops() -> None:
    grads = tensors(torch.float16) + tensors(torch.bfloat16, 1) + tensors(torch.float32)
    found_inf = torch.zeros((), device=CUDA)
    inv_scale = torch.tensor(0.25, device=CUDA)
    ops.unscale_(grads, found_inf, inv_scale)
    ops.check_and_norm_(grads, found_inf, torch.zeros((), device=CUDA), inv_scale)
    torch.ops.fusedamp.grad_stats(grads, inv_scale)
    empty = [torch.empty(0, dtype=dtype, device=CUDA) for dtype in (torch.float16, torch.float32)]
    ops.check_and_norm_(empty, found_inf, torch.zeros((), device=CUDA), inv_scale)
    torch.ops.fusedamp.grad_stats(empty, inv_scale)
    print("unscale_, check_and_norm_, grad_stats: mixed dtypes, only empty grads")


def gemms() -> None:
    major, minor = torch.cuda.get_device_capability()
    kernels = [
        k
        for k in fusedamp.build_info()["gemm_kernels"]
        if (k == "mma_sync" and major >= 8) or (k == "wgmma" and (major, minor) == (9, 0))
    ]
    # Tails in M, N and K; B as nn.Linear passes it (W.t()) and row-major.
    a = torch.randn(200, 72, device=CUDA).half()
    bias = torch.randn(264, device=CUDA)
    for kernel in kernels:
        previous = _C.set_gemm_backend(kernel)
        try:
            for b in (torch.randn(264, 72, device=CUDA).half().t(), torch.randn(72, 264, device=CUDA).half()):
                ops.gemm(a, b, bias, "gelu")
        finally:
            _C.set_gemm_backend(previous)
        print(f"gemm: {kernel}")


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitizer_subset: skipped, needs a CUDA GPU")
        return 0
    torch.manual_seed(0)
    optimizer_steps()
    coded_steps()
    grad_ops()
    gemms()
    torch.cuda.synchronize()
    print("sanitizer_subset: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

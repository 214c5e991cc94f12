"""The CUDA launcher's tuning sweep: the memory-bound steps of the optimizer benchmark (64M
elements in 200 tensors) under each launch variant, in one process. The variants are run-time
settings of the extension (``fusedamp._C.set_cuda_launch_settings``): the kernel parameter budget
(4 KB or 32 KB, i.e. how many tensors one launch holds), the chunk size (elements per block), for
unscale_ and the check the unroll depth (16-byte pieces in flight per thread), and for the steps
with int8 moments the coded kernels' layout (coded_runs: 1, a codec block over two warps, its
scale reduced between two block barriers; 2, a codec block per warp, reduced within it).

Per mode and variant: the kernel time (torch.profiler, the sum of the step's CUDA kernels), the
wall time of a step on the device (CUDA events around the calls), the host time to issue one
step (the call alone, the device idle before it) and the kernel launches per step; the achieved
bandwidth counts the bytes the mode moves (bench_optim's and bench_unscale's counts) and is a
share of the same run's in-place stream rate (``a.add_(x, alpha)``, 12 B/element).

Run from the repository root: python -m benchmarks.sweep_launch [--json PATH]

Without a GPU it runs every mode and variant once on small sizes (the GPU check's dry run): the
settings change nothing on a CPU and no time it prints means anything.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import fusedamp
from benchmarks.bench_optim import TENSORS, job_bytes, param_sizes, stream_peer
from benchmarks.common import environment, format_table, write_json
from fusedamp.optim import FusedAdamW, FusedSGD

PARAM_BYTES = (4096, 32764)
CHUNK_SIZES = (2**14, 2**15, 2**16, 2**17)
GRAD_UNROLLS = (2, 4, 8)
CODED_RUNS = (1, 2)
# (optimizer, param dtype, options, bench_optim's peer name for its bytes per param).
OPTIMIZER_MODES = {
    "adamw fp32": ("adamw", torch.float32, {}, "fusedamp"),
    "adamw bf16 + fp32 master": ("adamw", torch.bfloat16, {}, "fusedamp"),
    "adamw bf16 + remainder": (
        "adamw", torch.bfloat16, {"master_weights": "remainder"}, "fusedamp remainder",
    ),
    "adamw fp32, int8 moments": ("adamw", torch.float32, {"moments": "int8"}, "fusedamp int8 moments"),
    "adamw bf16 + remainder, int8 moments": (
        "adamw", torch.bfloat16, {"master_weights": "remainder", "moments": "int8"},
        "fusedamp remainder int8",
    ),
    "sgd fp32": ("sgd", torch.float32, {"momentum": 0.9}, "fusedamp"),
    "sgd bf16 + fp32 master": ("sgd", torch.bfloat16, {"momentum": 0.9}, "fusedamp"),
}
# The grad ops: dtype and bytes per element (unscale_ reads and writes, the check only reads).
GRAD_MODES = {"unscale_ fp32": (torch.float32, 8), "check + norm bf16": (torch.bfloat16, 2)}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def optimizer_step(mode: str, sizes: list[int], device: str) -> tuple[Callable[[], object], int]:
    """One optimizer step over fresh params and grads, and the bytes it moves."""
    kind, dtype, options, peer = OPTIMIZER_MODES[mode]
    params = [torch.randn(n, device=device).to(dtype).requires_grad_() for n in sizes]
    for param in params:
        param.grad = torch.randn(param.shape, device=device).to(dtype)
    optimizer = (FusedAdamW if kind == "adamw" else FusedSGD)(params, lr=1e-3, **options)
    return optimizer.step, job_bytes(kind, peer, dtype, sum(sizes))


def grad_op(mode: str, sizes: list[int], device: str) -> tuple[Callable[[], object], int]:
    dtype, element_bytes = GRAD_MODES[mode]
    grads = [torch.randn(n, device=device).to(dtype) for n in sizes]
    found_inf = torch.zeros((), device=device)
    one = torch.ones((), device=device)
    if mode.startswith("unscale_"):
        return (lambda: fusedamp.ops.unscale_(grads, found_inf, one)), element_bytes * sum(sizes)
    total = torch.zeros((), device=device)
    return (lambda: fusedamp.ops.check_and_norm_(grads, found_inf, total, one)), element_bytes * sum(sizes)


def kernel_time(step: Callable[[], object], device: str, steps: int) -> tuple[float | None, float | None]:
    """Seconds of CUDA kernels per step and kernel launches per step, from torch.profiler (None
    without a GPU)."""
    if device != "cuda":
        return None, None
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(steps):
            step()
        synchronize(device)
    micros, launches = 0.0, 0
    for event in profile.key_averages():
        own = getattr(event, "self_device_time_total", None)
        own = getattr(event, "self_cuda_time_total", 0.0) if own is None else own
        if own > 0:
            micros += own
            launches += event.count
    return micros * 1e-6 / steps, launches / steps


def device_time(step: Callable[[], object], device: str, rounds: int) -> float:
    """Seconds per step on the device, the steps back to back (CUDA events; a clock on a CPU)."""
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(rounds):
            step()
        return (time.perf_counter() - start) / rounds
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(rounds):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e-3 / rounds


def host_time(step: Callable[[], object], device: str, rounds: int) -> float:
    """Median seconds the host takes to issue one step, the device idle before each."""
    samples = []
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    synchronize(device)
    return sorted(samples)[len(samples) // 2]


def stream_rate(numel: int, device: str, rounds: int) -> float:
    """GB/s of the in-place stream a.add_(x, alpha) over `numel` fp32 elements."""
    stream, stream_bytes = stream_peer(numel, device)
    stream()
    return stream_bytes / device_time(stream, device, rounds) / 1e9


def sweep(
    sizes: list[int], device: str, rounds: int, modes: list[str], chunk_sizes: tuple[int, ...],
    param_bytes: tuple[int, ...], grad_unrolls: tuple[int, ...], coded_runs: tuple[int, ...],
) -> dict[str, Any]:
    stream = stream_rate(sum(sizes), device, rounds)
    rows = []
    previous = fusedamp._C.set_cuda_launch_settings()
    try:
        for mode in modes:
            make = optimizer_step if mode in OPTIMIZER_MODES else grad_op
            step, moved = make(mode, sizes, device)
            step()  # the optimizers' state
            unrolls = (None,) if mode in OPTIMIZER_MODES else grad_unrolls
            layouts = coded_runs if mode in OPTIMIZER_MODES and int8_moments(mode) else (None,)
            variants = [
                (b, c, u, r) for b in param_bytes for c in chunk_sizes for u in unrolls for r in layouts
            ]
            for budget, chunk_size, unroll, runs in variants:
                fusedamp._C.set_cuda_launch_settings(
                    chunk_size=chunk_size, param_bytes=budget, grad_unroll=unroll, coded_runs=runs
                )
                step()
                kernels, launches = kernel_time(step, device, steps=3)
                wall = device_time(step, device, rounds)
                seconds = kernels if kernels else wall
                rows.append({
                    "mode": mode,
                    "param_bytes": budget,
                    "chunk_size": chunk_size,
                    "grad_unroll": unroll,
                    "coded_runs": runs,
                    "kernel_ms": None if kernels is None else kernels * 1e3,
                    "wall_ms": wall * 1e3,
                    "host_ms": host_time(step, device, rounds) * 1e3,
                    "launches_per_step": launches,
                    "bytes": moved,
                    "gb_per_s": moved / seconds / 1e9,
                    "share_of_stream": moved / seconds / 1e9 / stream,
                })
            del step
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        fusedamp._C.set_cuda_launch_settings(**previous)
    return {"stream_gb_per_s": stream, "rows": rows}


def int8_moments(mode: str) -> bool:
    """Whether an optimizer mode's states are 8-bit (its kernels take the layouts of coded_runs)."""
    return OPTIMIZER_MODES[mode][2].get("moments") == "int8"


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--elements", type=int, help="elements of the step (default: 64M on a GPU, 64K else)")
    parser.add_argument("--tensors", type=int, default=TENSORS)
    parser.add_argument("--rounds", type=int, help="timed steps per variant (default: 10 on a GPU, 1 else)")
    parser.add_argument("--modes", help="comma-separated modes (default: all)")
    parser.add_argument("--chunk-sizes", default=",".join(map(str, CHUNK_SIZES)))
    parser.add_argument("--param-bytes", default=",".join(map(str, PARAM_BYTES)))
    parser.add_argument("--grad-unrolls", default=",".join(map(str, GRAD_UNROLLS)))
    parser.add_argument("--coded-runs", default=",".join(map(str, CODED_RUNS)))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    elements = args.elements or (64 << 20 if gpu else 64 << 10)
    rounds = args.rounds or (10 if gpu else 1)
    modes = args.modes.split(",") if args.modes else [*OPTIMIZER_MODES, *GRAD_MODES]
    unknown = [mode for mode in modes if mode not in OPTIMIZER_MODES and mode not in GRAD_MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {[*OPTIMIZER_MODES, *GRAD_MODES]}")
    sizes = param_sizes(elements, args.tensors)
    result = sweep(
        sizes, args.device, rounds, modes, numbers(args.chunk_sizes), numbers(args.param_bytes),
        numbers(args.grad_unrolls), numbers(args.coded_runs),
    )
    print(f"sweep_launch: {sum(sizes)} elements in {len(sizes)} tensors on {args.device}, "
          f"in-place stream {result['stream_gb_per_s']:.0f} GB/s")
    columns = ["mode", "param_bytes", "chunk_size", "grad_unroll", "coded_runs", "kernel_ms", "wall_ms",
               "host_ms", "launches_per_step", "share_of_stream"]
    print(format_table(result["rows"], columns))
    write_json(args.json, {"environment": environment(args.device), "elements": sum(sizes),
                           "tensors": len(sizes), "rounds": rounds, **result})


if __name__ == "__main__":
    main()

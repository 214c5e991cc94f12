"""FusedMuon steps against torch.optim.Muon on the hidden matrices of a small transformer.

Run from the repository root: python -m benchmarks.bench_muon [--device cpu] [--json PATH]

The matrices are those of ``LAYERS`` transformer blocks of width ``WIDTH`` (attention in and out
projections, the two MLP matrices): four shapes, each ``LAYERS`` times, which FusedMuon
orthogonalizes as one batch per shape and torch's Muon one matrix at a time. Both orthogonalize
in bfloat16. Rows: fp32 params (torch's Muon, FusedMuon with fp32 and with int8 momentum) and bf16
params (torch's Muon keeps no master and a bf16 buffer; FusedMuon a bf16 remainder master and
int8 momentum), with the state's bytes per param at rest beside each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    benchmark_args,
    environment,
    format_table,
    round_ratio_range,
    stable_medians,
    thread_counts,
    time_round_robin,
    write_json,
)
from fusedamp.optim import FusedMuon

WIDTH = {"cpu": 256, "cuda": 1024}
LAYERS = 4


def matrices(width: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * LAYERS
    params = []
    for shape in shapes:
        param = (torch.randn(shape, generator=generator) * 0.02).to(device=device, dtype=dtype)
        param.grad = (torch.randn(shape, generator=generator) * 1e-3).to(device=device, dtype=dtype)
        params.append(param.requires_grad_())
    return params


def state_bytes_per_param(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    total = sum(
        value.numel() * value.element_size()
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return total / sum(param.numel() for param in params)


def peers(dtype: torch.dtype, device: str) -> dict[str, tuple[torch.optim.Optimizer, list[torch.Tensor]]]:
    width = WIDTH["cuda" if device.startswith("cuda") else "cpu"]
    made: dict[str, tuple[torch.optim.Optimizer, list[torch.Tensor]]] = {}
    params = matrices(width, dtype, device)
    made["torch"] = (torch.optim.Muon(params, lr=0.02), params)
    if dtype == torch.float32:
        modes = {"fusedamp": {}, "fusedamp int8 momentum": {"moments": "int8"}}
    else:
        modes = {"fusedamp": {"master_weights": "remainder", "moments": "int8"}}
    for name, options in modes.items():
        params = matrices(width, dtype, device)
        made[name] = (FusedMuon(params, lr=0.02, **options), params)
    return made


def measure(dtype: torch.dtype, device: str, rounds: int, threads: int) -> list[dict[str, Any]]:
    made = peers(dtype, device)
    steps: dict[str, Callable[[], object]] = {name: opt.step for name, (opt, _) in made.items()}
    samples = time_round_robin(steps, device, rounds)
    medians, _ = stable_medians(samples)
    elements = sum(param.numel() for param in next(iter(made.values()))[1])
    params = "fp32 params" if dtype == torch.float32 else "bf16 params"
    case = f"{params}, {elements / 1e6:.1f}M in 2-D matrices, {threads} threads"
    rows = []
    for name, (opt, params) in made.items():
        spread = round_ratio_range(samples, name, "fusedamp") if name != "fusedamp" else None
        spread_text = None if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}"
        rows.append({
            "bench": "muon",
            "case": case,
            "impl": name,
            "device": device,
            "threads": threads,
            "time_ms": medians[name] * 1e3,
            "state B/param": round(state_bytes_per_param(opt, params), 2),
            "ratio spread (p10-p90)": spread_text,
        })
    return rows


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0])
    rows: list[dict[str, Any]] = []
    for threads in thread_counts(args.threads, args.device):
        if args.device == "cpu":
            torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            rows += measure(dtype, args.device, args.rounds, threads)
    columns = ["case", "impl", "time_ms", "state B/param", "ratio spread (p10-p90)"]
    print(format_table(rows, columns))
    write_json(args.json, {"rows": rows, "environment": environment(args.device)})


if __name__ == "__main__":
    main()

"""GEMM throughput: fusedamp's kernels vs torch.matmul, and the fused Linear+bias+GELU forward vs
F.gelu(F.linear(...)), for square and transformer-MLP shapes; prints a table, writes JSON.

    python -m benchmarks.bench_gemm --json out/bench_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedamp import _C, ops

SQUARE = [1024, 2048, 4096, 8192]
MLP_TOKENS = [4096, 8192, 16384]
MLP_D = 4096


def seconds(fn: Callable[[], object], iters: int = 20) -> float:
    """Median time of one call, by CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def tflops(m: int, n: int, k: int, s: float) -> float:
    return 2 * m * n * k / s / 1e12


def kernel_backends() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    return (["mma_sync"] if major >= 8 else []) + (["wgmma"] if (major, minor) == (9, 0) else [])


def bench_case(name: str, m: int, n: int, k: int, dtype: torch.dtype) -> dict[str, object]:
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    row: dict[str, object] = {"case": name, "m": m, "n": n, "k": k, "dtype": str(dtype)[6:]}
    row["torch.matmul"] = tflops(m, n, k, seconds(lambda: torch.matmul(x, w.t())))
    row["torch gelu(linear)"] = tflops(m, n, k, seconds(lambda: F.gelu(F.linear(x, w, bias))))
    for backend in kernel_backends():
        previous = _C.set_gemm_backend(backend)
        try:
            row[backend] = tflops(m, n, k, seconds(lambda: ops.gemm(x, w.t())))
            row[f"{backend} gelu"] = tflops(
                m, n, k, seconds(lambda: ops.gemm(x, w.t(), bias, "gelu")))
        finally:
            _C.set_gemm_backend(previous)
        row[f"{backend}/torch"] = row[backend] / row["torch.matmul"]
        row[f"{backend} gelu/torch"] = row[f"{backend} gelu"] / row["torch gelu(linear)"]
    return row


def runner_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The table in python -m benchmarks' row format: one row per (case, implementation); the
    preferred kernel of this GPU is "fusedamp", the other one a peer beside torch."""
    backends = kernel_backends()
    out = []
    for row in rows:
        flops = 2 * int(row["m"]) * int(row["n"]) * int(row["k"])
        for epilogue, torch_key in (("", "torch.matmul"), (" gelu", "torch gelu(linear)")):
            case = f"{row['case']} {row['dtype']}" + (" +bias+gelu" if epilogue else "")
            impls = {"torch": row[torch_key]}
            for backend in backends:
                name = "fusedamp" if backend == backends[-1] else f"fusedamp-{backend}"
                impls[name] = row[f"{backend}{epilogue}"]
            for impl, rate in impls.items():
                out.append({"bench": "gemm", "case": case, "impl": impl, "device": "cuda",
                            "tflops": rate, "time_ms": flops / (float(rate) * 1e12) * 1e3})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("out/bench_gemm.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA GPU here; nothing to measure (skipped).")
        return 77  # python -m benchmarks reads 77 as "not supported on this machine"
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for s in SQUARE:
            rows.append(bench_case(f"square {s}", s, s, s, dtype))
        for tokens in MLP_TOKENS:
            rows.append(bench_case(f"mlp up t={tokens}", tokens, 4 * MLP_D, MLP_D, dtype))
            rows.append(bench_case(f"mlp down t={tokens}", tokens, MLP_D, 4 * MLP_D, dtype))
    columns = [c for c in rows[0] if c not in ("m", "n", "k")]
    print(" | ".join(f"{c:>18}" for c in columns))
    for row in rows:
        print(" | ".join(f"{row[c]:>18.3f}" if isinstance(row[c], float) else f"{row[c]:>18}"
                         for c in columns))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "unit": "TFLOP/s",
                                     "rows": runner_rows(rows), "table": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GEMM throughput: fusedamp's kernels vs torch.matmul, and the fused bias + GELU epilogue vs
F.gelu(F.linear(...)), for square and transformer-MLP shapes and a K sweep; prints a table, writes
JSON.

    python -m benchmarks.bench_gemm --json out/bench_gemm.json      # python -m benchmarks' rows
    python -m benchmarks.bench_gemm --sweep --json out/gemm_sweep.json
    python -m benchmarks.bench_gemm --sweep --cases k --backends wgmma_pingpong --dtypes bf16 --dry-run

Every time is the median over repeats of one batch of back-to-back calls (sized to about 20 ms),
divided by the calls: the GPU queue stays full, so the gaps between launches are not what is
measured as long as the host enqueues a call faster than the GPU runs it. `--timing graph` captures
the same batch in a CUDA graph and replays it (no host work at all between the kernels); the sweep
records both. The sweep also fits time = a + b * K per output tile over the K sweep (the fixed cost
per tile, e.g. the epilogue, against the main loop's cost per unit of K) for each implementation.
The wgmma kernel's two schedules (cooperative 128 x 256 tiles, ping-pong 128 x 128 tiles) are timed
forced, beside `wgmma`'s per-shape choice of them: the columns that set that choice. Each fusedamp
result is first compared with torch's; a wrong one is reported (stderr and the JSON's "error") and
not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fusedamp import _C, ops

SQUARE = [1024, 2048, 4096, 8192]
MLP_TOKENS = [4096, 8192, 16384]
MLP_D = 4096
K_SWEEP = [256, 512, 1024, 2048, 4096, 8192, 16384]
K_SWEEP_MN = 4096  # M = N of the K sweep: 512 wgmma tiles, about 4 waves of 132 SMs
CASE_GROUPS = ("square", "mlp", "k")
EPILOGUES = ("none", "bias", "bias_gelu")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TIMINGS = ("stream", "graph")
# wgmma picks its schedule per shape; the forced schedules are timed beside it to move that choice.
BACKENDS = ("mma_sync", "wgmma_cooperative", "wgmma_pingpong", "wgmma")
# (BLK_M, BLK_N) of an implementation's output tile for the per-tile fit (the K sweep's 4096 x 4096
# is a cooperative wgmma problem); the 128 x 256 tile for the others, to compare like with like.
FIT_TILE = {"wgmma_pingpong": (128, 128)}
DEFAULT_FIT_TILE = (128, 256)
BATCH_S = 0.02  # the length of one timed batch of back-to-back calls
REPEATS = 5


@dataclass(frozen=True)
class Case:
    name: str
    m: int
    n: int
    k: int


def cases(groups: list[str]) -> list[Case]:
    found = []
    if "square" in groups:
        found += [Case(f"square {s}", s, s, s) for s in SQUARE]
    if "mlp" in groups:
        for tokens in MLP_TOKENS:
            found.append(Case(f"mlp up t={tokens}", tokens, 4 * MLP_D, MLP_D))
            found.append(Case(f"mlp down t={tokens}", tokens, MLP_D, 4 * MLP_D))
    if "k" in groups:
        side = K_SWEEP_MN
        found += [Case(f"k sweep {side}x{side} k={k}", side, side, k) for k in K_SWEEP]
    return found


def batch_seconds(fn: Callable[[], object], calls: int, timing: str, repeats: int) -> float:
    """Median time of one call over `repeats` batches of `calls` back-to-back calls."""
    if timing == "graph":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the side stream, as torch.cuda.graphs asks before a capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run: Callable[[], object] = graph.replay
        run()
    else:

        def run() -> None:
            for _ in range(calls):
                fn()

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def seconds(fn: Callable[[], object], timing: str = "stream", repeats: int = REPEATS) -> float:
    """Time of one call: a warm-up, one call to size the batches (about BATCH_S each), then the
    median of the batches."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = max(start.elapsed_time(end) / 1e3, 1e-6)
    calls = max(2, min(200, math.ceil(BATCH_S / one)))
    return batch_seconds(fn, calls, timing, repeats)


def tflops(m: int, n: int, k: int, s: float) -> float:
    return 2 * m * n * k / s / 1e12


def kernel_backends() -> list[str]:
    """The backends this GPU runs, its preferred one last (runner_rows calls it "fusedamp")."""
    major, minor = torch.cuda.get_device_capability()
    wgmma = ["wgmma_cooperative", "wgmma_pingpong", "wgmma"]
    return (["mma_sync"] if major >= 8 else []) + (wgmma if (major, minor) == (9, 0) else [])


def calls_for(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
              epilogue: str) -> dict[str, Callable[[], object]]:
    """torch's and fusedamp's call of one epilogue; fusedamp's runs the backend set when timed."""
    if epilogue == "none":
        return {"torch": lambda: torch.matmul(x, w.t()), "fusedamp": lambda: ops.gemm(x, w.t())}
    if epilogue == "bias":
        return {"torch": lambda: F.linear(x, w, bias), "fusedamp": lambda: ops.gemm(x, w.t(), bias)}
    return {"torch": lambda: F.gelu(F.linear(x, w, bias)),
            "fusedamp": lambda: ops.gemm(x, w.t(), bias, "gelu")}


def result_error(ours: torch.Tensor, reference: torch.Tensor) -> str:
    """Why fusedamp's output does not stand for torch's, or "" when it does: the same shape, finite
    where torch's is, and each element within 2^-6 of torch's plus 2^-10 of its RMS. Two fp32
    accumulations rounded once to 16 bits differ by an output ulp or so; a skipped tile, a wrong
    operand or bias is off by the values themselves. A wrong result is not timed."""
    if ours.shape != reference.shape:
        return f"wrong result: shape {tuple(ours.shape)}, torch's {tuple(reference.shape)}"
    ours, reference = ours.float(), reference.float()
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(ours), finite):
        return "wrong result: non-finite elements where torch's are finite, or the reverse"
    ours, reference = ours[finite], reference[finite]
    if reference.numel() == 0:
        return ""
    tolerance = 2**-6 * reference.abs() + 2**-10 * reference.square().mean().sqrt()
    wrong = int(((ours - reference).abs() > tolerance).sum())
    if wrong:
        worst = (ours - reference).abs().max().item()
        return (f"wrong result: {wrong} of {reference.numel()} elements off torch's "
                f"(largest error {worst:.3g})")
    return ""


@dataclass
class Measurement:
    case: str
    m: int
    n: int
    k: int
    dtype: str
    epilogue: str
    impl: str  # torch, or the fusedamp backend (one of BACKENDS)
    timing: str
    seconds: float | None  # None: this timing failed (the error is kept)
    tflops: float | None
    error: str = ""


def measure(case: Case, dtype: str, epilogues: list[str], backends: list[str],
            timings: list[str]) -> list[Measurement]:
    x = torch.randn(case.m, case.k, device="cuda", dtype=DTYPES[dtype])
    w = torch.randn(case.n, case.k, device="cuda", dtype=DTYPES[dtype])
    bias = torch.randn(case.n, device="cuda", dtype=DTYPES[dtype])
    found = []
    for epilogue in epilogues:
        fns = calls_for(x, w, bias, epilogue)
        expected = fns["torch"]()
        for impl in ["torch", *backends]:
            fn = fns["torch" if impl == "torch" else "fusedamp"]
            previous = _C.set_gemm_backend(impl) if impl != "torch" else None
            try:
                wrong = "" if impl == "torch" else result_error(fn(), expected)
                if wrong:
                    print(f"bench_gemm: {case.name} {dtype} {epilogue} {impl}: {wrong}",
                          file=sys.stderr, flush=True)
                for timing in timings:
                    s: float | None = None
                    error = wrong
                    if not wrong:
                        try:
                            s = seconds(fn, timing)
                        except RuntimeError as e:  # e.g. a capture the op does not allow
                            error = f"{type(e).__name__}: {e}"[:300]
                    found.append(Measurement(case.name, case.m, case.n, case.k, dtype, epilogue, impl,
                                             timing, s, tflops(case.m, case.n, case.k, s) if s else None,
                                             error))
            finally:
                if previous is not None:
                    _C.set_gemm_backend(previous)
    return found


def fit_per_tile(measurements: list[Measurement]) -> list[dict[str, object]]:
    """Least-squares time = a + b * K per output tile (FIT_TILE) over the K sweep, for each
    (dtype, epilogue, impl, timing): a is the fixed cost of a tile, b its cost per unit of K."""
    groups: dict[tuple[str, str, str, str], list[Measurement]] = {}
    for r in measurements:
        if r.case.startswith("k sweep") and r.seconds is not None:
            groups.setdefault((r.dtype, r.epilogue, r.impl, r.timing), []).append(r)
    fits = []
    for (dtype, epilogue, impl, timing), rows in groups.items():
        if len(rows) < 2:
            continue
        block_m, block_n = FIT_TILE.get(impl, DEFAULT_FIT_TILE)
        tiles = math.ceil(K_SWEEP_MN / block_m) * math.ceil(K_SWEEP_MN / block_n)
        ks = [r.k for r in rows]
        ts = [r.seconds / tiles for r in rows]
        mean_k, mean_t = sum(ks) / len(ks), sum(ts) / len(ts)
        covariance = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, ts, strict=True))
        b = covariance / sum((k - mean_k) ** 2 for k in ks)
        a = mean_t - b * mean_k
        fits.append({"dtype": dtype, "epilogue": epilogue, "impl": impl, "timing": timing,
                     "tiles": tiles, "fixed_us_per_tile": a * 1e6, "ns_per_k_per_tile": b * 1e9})
    return fits


def print_table(measurements: list[Measurement]) -> None:
    """One line per (case, dtype, epilogue, timing): torch's TFLOP/s and each backend's ratio."""
    keyed = {(r.case, r.dtype, r.epilogue, r.timing, r.impl): r for r in measurements}
    impls = list(dict.fromkeys(r.impl for r in measurements if r.impl != "torch"))
    print(f"{'case':34} {'dtype':5} {'epilogue':9} {'timing':6} {'torch TFLOP/s':>13} "
          + " ".join(f"{impl + '/torch':>15}" for impl in impls))
    for case, dtype, epilogue, timing in dict.fromkeys(k[:4] for k in keyed):
        peer = keyed[case, dtype, epilogue, timing, "torch"]
        cells = []
        for impl in impls:
            r = keyed.get((case, dtype, epilogue, timing, impl))
            ok = r is not None and r.tflops and peer.tflops
            cells.append(f"{r.tflops / peer.tflops:15.2f}" if ok else f"{'-':>15}")
        rate = f"{peer.tflops:13.1f}" if peer.tflops else f"{'-':>13}"
        print(f"{case:34} {dtype:5} {epilogue:9} {timing:6} {rate} " + " ".join(cells))


def runner_rows(measurements: list[Measurement], backends: list[str]) -> list[dict[str, object]]:
    """python -m benchmarks' rows: one per (case, implementation); this GPU's preferred kernel is
    "fusedamp", the other one a peer beside torch. Cases are named "<shape> <dtype>", with
    " +bias+gelu" for the fused epilogue (benchmarks/summary.py's GEMM table reads them)."""
    out = []
    for r in measurements:
        if r.timing != "stream" or r.epilogue not in ("none", "bias_gelu") or r.tflops is None:
            continue
        if r.impl == "torch":
            impl = "torch"
        else:
            impl = "fusedamp" if r.impl == backends[-1] else f"fusedamp-{r.impl}"
        case = f"{r.case} {str(DTYPES[r.dtype])[6:]}" + (" +bias+gelu" if r.epilogue == "bias_gelu" else "")
        out.append({"bench": "gemm", "case": case, "impl": impl, "device": "cuda", "tflops": r.tflops,
                    "time_ms": r.seconds * 1e3})
    return out


def split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v for v in value.split(",") if v]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{what}: choose from {', '.join(allowed)}, got {value!r}")
    return items


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("out/bench_gemm.json"))
    parser.add_argument("--sweep", action="store_true",
                        help="every case group, both timings, and the per-tile fit (the GPU sweep)")
    parser.add_argument("--cases", type=lambda v: split(v, CASE_GROUPS, "--cases"),
                        help=f"case groups, comma-separated ({', '.join(CASE_GROUPS)}; default: "
                        "square,mlp, with --sweep all)")
    parser.add_argument("--dtypes", type=lambda v: split(v, tuple(DTYPES), "--dtypes"),
                        default=list(DTYPES))
    parser.add_argument("--epilogues", type=lambda v: split(v, EPILOGUES, "--epilogues"),
                        default=["none", "bias_gelu"])
    parser.add_argument("--backends", type=lambda v: split(v, BACKENDS, "--backends"),
                        help="fusedamp kernels to time (default: those this GPU runs)")
    parser.add_argument("--timing", type=lambda v: split(v, TIMINGS, "--timing"),
                        help="stream (back-to-back calls) and/or graph (the calls in a CUDA graph); "
                        "default: stream, with --sweep both")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be measured and measure nothing (no GPU needed)")
    args = parser.parse_args()
    groups = args.cases or (list(CASE_GROUPS) if args.sweep else ["square", "mlp"])
    timings = args.timing or (list(TIMINGS) if args.sweep else ["stream"])
    planned = cases(groups)
    if args.dry_run:
        backends = args.backends or list(BACKENDS)
        for case in planned:
            print(f"bench_gemm: would time {case.name} (M={case.m} N={case.n} K={case.k}) for "
                  f"{','.join(args.dtypes)} x {','.join(args.epilogues)} x torch,{','.join(backends)} "
                  f"x {','.join(timings)}")
        count = len(planned) * len(args.dtypes) * len(args.epilogues) * (1 + len(backends)) * len(timings)
        print(f"bench_gemm: dry run, {count} timings planned")
        return 0
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA GPU here; nothing to measure (skipped).")
        return 77  # python -m benchmarks reads 77 as "not supported on this machine"
    backends = args.backends or kernel_backends()
    measurements = []
    for dtype in args.dtypes:
        for case in planned:
            measurements += measure(case, dtype, args.epilogues, backends, timings)
            print(f"bench_gemm: {case.name} {dtype} done", file=sys.stderr, flush=True)
    print_table(measurements)
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "unit": "TFLOP/s",
                                 "rows": runner_rows(measurements, backends) if backends else [],
                                 "table": [asdict(r) for r in measurements]}
    if "k" in groups:
        result["fits"] = fit_per_tile(measurements)
        for fit in result["fits"]:
            print(f"fit {fit['dtype']} {fit['epilogue']} {fit['impl']} {fit['timing']}: "
                  f"{fit['fixed_us_per_tile']:.2f} us + {fit['ns_per_k_per_tile']:.3f} ns x K per tile")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

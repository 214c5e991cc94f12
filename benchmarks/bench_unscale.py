"""fusedamp.ops.unscale_ and the read-only check_and_norm_ against torch's
_amp_foreach_non_finite_check_and_unscale_, as fractions of the copy bandwidth and of the
in-place stream ceiling (``a.mul_(s)`` over the same bytes: one read and one write, as an
unscale makes).

Run from the repository root: python -m benchmarks.bench_unscale [--device cpu] [--json PATH]

On CPU every op is timed at each thread count of ``--threads`` (default: 1 and all).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from benchmarks.common import (
    benchmark_args,
    copy_peer,
    environment,
    format_table,
    gigabytes_per_second,
    stable_medians,
    thread_counts,
    time_round_robin,
    write_json,
)
from fusedamp import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TENSORS = 200
DEFAULT_ELEMENTS = {"cpu": 16 << 20, "cuda": 256 << 20}
TORCH = "torch unscale"
STREAM = "stream a.mul_(s)"
# Passes over the grad bytes each op makes: unscale reads and writes, the checks only read.
PASSES = {"fusedamp unscale_": 2, TORCH: 2, "fusedamp check (read-only)": 1, "fusedamp check + norm": 1}
# The speed targets, as speedups over torch's unscale at the most threads.
TARGETS = {"fusedamp unscale_": 1.2, "fusedamp check (read-only)": 1.5}


def grad_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` odd sizes within 0.5x-1.5x of the mean, adding up to about ``total``."""
    rng = random.Random(seed)
    mean = total // count
    sizes = [rng.randrange(mean // 2, mean * 3 // 2) | 1 for _ in range(count - 1)]
    return sizes + [max(total - sum(sizes), 1)]


def alternating_inv_scales(device: str) -> Callable[[], torch.Tensor]:
    """0.5, 2, 0.5, 2, ...: every call multiplies, yet the values come back exactly every
    other call (no drift into subnormals or inf)."""
    values = itertools.cycle([torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)])
    return lambda: next(values)


def peers_for(dtype: torch.dtype, sizes: list[int], device: str) -> dict[str, Callable[[], object]]:
    """The timed calls for one dtype; each in-place peer owns its grads and inverse scales."""

    def grads() -> list[torch.Tensor]:
        return [torch.randn(n, device=device).to(dtype) for n in sizes]

    found_inf = torch.zeros((), device=device)
    sum_of_squares = torch.zeros((), device=device)
    ours, theirs, checked = grads(), grads(), grads()
    our_inv_scale, their_inv_scale = alternating_inv_scales(device), alternating_inv_scales(device)
    peers = {
        "fusedamp unscale_": lambda: ops.unscale_(ours, found_inf, our_inv_scale()),
        TORCH: lambda: torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_inf, their_inv_scale()),
        "fusedamp check (read-only)": lambda: ops.check_and_norm_(checked, found_inf),
        "fusedamp check + norm": lambda: ops.check_and_norm_(checked, found_inf, sum_of_squares),
    }
    try:
        peers[TORCH]()
    except RuntimeError:  # a torch build without this dtype on this device
        del peers[TORCH]
    return peers


def measure(dtype_name: str, sizes: list[int], device: str, rounds: int, threads: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    grad_bytes = sum(sizes) * dtype.itemsize
    peers = peers_for(dtype, sizes, device)
    peers["copy"], copy_bytes = copy_peer(grad_bytes, device)
    peers[STREAM], stream_bytes = stream_peer(grad_bytes, device)
    medians, kept = stable_medians(time_round_robin(peers, device, rounds))
    copy_rate = gigabytes_per_second(copy_bytes, medians["copy"])
    stream_rate = gigabytes_per_second(stream_bytes, medians[STREAM])
    case = dtype_name if torch.device(device).type != "cpu" else f"{dtype_name}, {threads} threads"
    rows = []
    for name, passes in PASSES.items():
        row = {"dtype": case, "op": name, "threads": threads, "samples kept": f"{kept}/{rounds}"}
        if name in medians:
            rate = gigabytes_per_second(passes * grad_bytes, medians[name])
            row.update({"ms": medians[name] * 1e3, "GB/s": rate, "% of copy": 100 * rate / copy_rate,
                        "% stream": 100 * rate / stream_rate})
            if TORCH in medians:
                row["vs torch unscale"] = medians[TORCH] / medians[name]
        else:
            row["op"] += " (not supported by this torch)"
        rows.append(row)
    for name, rate in (("copy", copy_rate), (STREAM, stream_rate)):
        rows.append({"dtype": case, "op": name, "threads": threads, "ms": medians[name] * 1e3,
                     "GB/s": rate, "% of copy": 100 * rate / copy_rate,
                     "% stream": 100 * rate / stream_rate, "samples kept": f"{kept}/{rounds}"})
    return rows


def stream_peer(nbytes: int, device: str) -> tuple[Callable[[], object], int]:
    """The in-place stream ceiling: ``a.mul_(s)`` over ``nbytes`` of float32 (the same bytes as
    the grads, without a half dtype's conversions), and the bytes it moves (read + write)."""
    a = torch.ones(nbytes // 4, device=device)
    return (lambda: a.mul_(1.0)), 2 * a.numel() * 4


def target_checks(rows: list[dict]) -> list[str]:
    most = max(row["threads"] for row in rows)
    lines = []
    for row in rows:
        target = TARGETS.get(row["op"])
        if row["threads"] == most and target and "vs torch unscale" in row:
            speedup = row["vs torch unscale"]
            verdict = "met" if speedup >= target else "MISSED"
            lines.append(f"target {row['op']} {row['dtype']}: {speedup:.2f}x torch unscale "
                         f"(>= {target}x): {verdict}")
    return lines


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0])
    device = args.device
    sizes = grad_sizes(DEFAULT_ELEMENTS[torch.device(device).type], TENSORS)
    rows = []
    for threads in thread_counts(args.threads, device):
        torch.set_num_threads(threads)
        for dtype_name in DTYPES:
            rows += measure(dtype_name, sizes, device, args.rounds, threads)
    print(f"{sum(sizes) / 2**20:.0f}M elements in {len(sizes)} tensors on {device}. "
          "'vs torch unscale': torch's time / this time; '% stream': of a.mul_(s); "
          "'samples kept': the fewest undisturbed samples of any peer of that dtype")
    print(format_table(rows, ["dtype", "op", "ms", "GB/s", "% of copy", "% stream", "vs torch unscale",
                              "samples kept"]))
    checks = target_checks(rows)
    for line in checks:
        print(line)
    write_json(args.json, {"benchmark": "unscale", "elements": sum(sizes), "tensors": len(sizes),
                           "environment": environment(device), "rows": rows, "targets": checks})


if __name__ == "__main__":
    main()

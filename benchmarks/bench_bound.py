"""What bounds an AdamW step, per element: its time with the data in L2 against its time from
memory, for fusedamp's fp32-moment and int8-moment steps and torch's AdamW(fused=True).

Run from the repository root: python -m benchmarks.bench_bound [--threads 1] [--json PATH]

A step's time per element in L2 (a 64k-element fp32 param, ~1 MB with its grad and state) is
what its instructions cost; from memory (16.8M elements) it adds the wait for its bytes. The
host cost of a step (the same step on 256 elements) is subtracted from both. A step whose in-L2
time is near or above a peer's time from memory cannot catch that peer by moving fewer bytes:
it is bound by its instructions (the bound to show where a row stays under 1.0x).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import fusedamp
from benchmarks.common import (
    benchmark_args,
    environment,
    format_table,
    thread_counts,
    time_round_robin,
    write_json,
)

HOST_ELEMENTS = 256
L2_ELEMENTS = 65_536
MEMORY_ELEMENTS = 16_777_216
STEPS_PER_SAMPLE = {HOST_ELEMENTS: 400, L2_ELEMENTS: 100, MEMORY_ELEMENTS: 1}
STEPS = {
    "fusedamp fp32 moments": lambda params: fusedamp.FusedAdamW(params, lr=1e-3),
    "fusedamp int8 moments": lambda params: fusedamp.FusedAdamW(params, lr=1e-3, moments="int8"),
    "torch AdamW(fused=True)": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
}


def repeated_step(make: Callable, numel: int) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(numel) * 0.1)
    param.grad = torch.randn(numel) * 0.01
    optimizer = make([param])
    steps = STEPS_PER_SAMPLE[numel]

    def run() -> None:
        for _ in range(steps):
            optimizer.step()

    return run


def seconds_per_step(numel: int, rounds: int) -> dict[str, float]:
    """Median seconds of one step of every peer on one tensor of numel elements (round-robin)."""
    peers = {name: repeated_step(make, numel) for name, make in STEPS.items()}
    samples = time_round_robin(peers, "cpu", rounds)
    steps = STEPS_PER_SAMPLE[numel]
    return {name: statistics.median(times) / steps for name, times in samples.items()}


def measure(threads: int, rounds: int) -> list[dict]:
    host = seconds_per_step(HOST_ELEMENTS, rounds)
    in_l2 = seconds_per_step(L2_ELEMENTS, rounds)
    from_memory = seconds_per_step(MEMORY_ELEMENTS, max(5, rounds // 3))
    rows = []
    for name in STEPS:
        l2_ns = (in_l2[name] - host[name]) / L2_ELEMENTS * 1e9
        memory_ns = (from_memory[name] - host[name]) / MEMORY_ELEMENTS * 1e9
        rows.append({
            "dtype": f"AdamW fp32 params, {threads} threads, ns per element",
            "op": name,
            "threads": threads,
            "ms": from_memory[name] * 1e3,
            "host us": host[name] * 1e6,
            "in L2 ns": l2_ns,
            "from memory ns": memory_ns,
            "memory / L2": memory_ns / l2_ns,
        })
    return rows


def findings(rows: list[dict]) -> list[str]:
    """For each fusedamp step: its in-L2 time as a fraction of the torch step's time from memory
    (near or above 1: its instructions alone take the peer's whole step)."""
    lines = []
    for threads in sorted({row["threads"] for row in rows}):
        group = {row["op"]: row for row in rows if row["threads"] == threads}
        peer = group["torch AdamW(fused=True)"]["from memory ns"]
        for name in ("fusedamp fp32 moments", "fusedamp int8 moments"):
            own = group[name]["in L2 ns"]
            lines.append(
                f"bound {name}, {threads} threads: {own:.3f} ns/element in L2, {own / peer:.2f}x torch "
                f"fused's {peer:.3f} from memory (its own from memory: {group[name]['from memory ns']:.3f})"
            )
    return lines


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0])
    if torch.device(args.device).type != "cpu":
        print("bench_bound measures CPU steps only")
        raise SystemExit(77)
    rows = []
    for threads in thread_counts(args.threads, "cpu"):
        torch.set_num_threads(threads)
        rows += measure(threads, args.rounds)
    print("Time per element of an AdamW step (host cost subtracted), in L2 and from memory, on cpu")
    print(format_table(rows, ["dtype", "op", "host us", "in L2 ns", "from memory ns", "memory / L2"]))
    lines = findings(rows)
    for line in lines:
        print(line)
    payload = {"benchmark": "bound", "environment": environment("cpu"), "rows": rows, "targets": lines}
    write_json(args.json, payload)


if __name__ == "__main__":
    main()

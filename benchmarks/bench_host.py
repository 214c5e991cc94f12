"""The host cost of an optimizer step: FusedAdamW / FusedSGD against torch's AdamW(fused=True) /
SGD(fused=True) over many tiny params (128 elements each, so that the kernels cost nothing and
the Python and dispatch work around them is what is timed), plain and under each one's
GradScaler (fusedamp.GradScaler for fusedamp, torch.amp.GradScaler for torch).

Run from the repository root: python -m benchmarks.bench_host [--device cpu] [--json PATH]

Each step is preceded, as in training, by fresh grads (new tensors, as backward makes after
zero_grad(set_to_none=True)); making them is outside the timed call. The target: a
fusedamp step at most 0.6x the time of torch's, at 200 and at 2000 params.
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
    round_ratio_range,
    thread_counts,
    time_round_robin,
    write_json,
)

PARAM_COUNTS = (200, 2000)
ELEMENTS = 128
TARGET = 0.6  # fusedamp's time / torch's
DISTURBANCE = 1.5  # a sample over this many times its peer's best is dropped (stable_medians' rule)


def stepper(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], scaler: object
) -> Callable[[], Callable[[], None]]:
    """A function that gives the params fresh grads and returns the timed step call."""

    def step() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.scale(ONE)
            scaler.step(optimizer)
            scaler.update()

    def prepare() -> Callable[[], None]:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        return step

    return prepare


ONE = torch.ones(())


def peers_for(
    kind: str, count: int, device: str, scaled: bool
) -> dict[str, Callable[[], Callable[[], None]]]:
    def params() -> list[torch.Tensor]:
        return [torch.nn.Parameter(torch.randn(ELEMENTS, device=device)) for _ in range(count)]

    grads = [torch.randn(ELEMENTS, device=device) for _ in range(count)]
    ours, theirs = params(), params()
    if kind == "AdamW":
        fused = fusedamp.FusedAdamW(ours, lr=1e-3)
        peer = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    else:
        fused = fusedamp.FusedSGD(ours, lr=0.1, momentum=0.9)
        peer = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, fused=True)
    our_scaler = fusedamp.GradScaler(device) if scaled else None
    their_scaler = torch.amp.GradScaler(device) if scaled else None
    return {
        "fusedamp": stepper(fused, ours, grads, our_scaler),
        f"torch {kind}(fused=True)": stepper(peer, theirs, grads, their_scaler),
    }


def measure(kind: str, count: int, scaled: bool, device: str, rounds: int, threads: int) -> list[dict]:
    peers = peers_for(kind, count, device, scaled)
    samples = time_round_robin(peers, device, rounds, warmup=5, prepared=True)
    clean = {name: [t <= DISTURBANCE * min(times) for t in times] for name, times in samples.items()}
    medians = {
        name: statistics.median(t for t, ok in zip(times, clean[name], strict=True) if ok)
        for name, times in samples.items()
    }
    spread = round_ratio_range(samples, "fusedamp", f"torch {kind}(fused=True)", DISTURBANCE)
    case = f"{kind} step, {count} params of {ELEMENTS}{' + GradScaler' if scaled else ''}, {threads} threads"
    kept = min(sum(flags) for flags in clean.values())
    rows = []
    for name in peers:
        row = {
            "dtype": case,
            "op": name,
            "threads": threads,
            "params": count,
            "scaled": scaled,
            "ms": medians[name] * 1e3,
            "us": medians[name] * 1e6,
            "samples kept": f"{kept}/{rounds}",
        }
        if name == "fusedamp":
            row["time vs torch"] = medians["fusedamp"] / medians[f"torch {kind}(fused=True)"]
            row["round ratios"] = f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "n/a"
        rows.append(row)
    return rows


def target_checks(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if "time vs torch" in row:
            ratio = row["time vs torch"]
            verdict = "met" if ratio <= TARGET else "MISSED"
            lines.append(
                f"target host cost {row['dtype']}: {ratio:.2f}x torch's time "
                f"(per round {row['round ratios']}; <= {TARGET}x): {verdict}"
            )
    return lines


def main() -> None:
    args = benchmark_args(__doc__.splitlines()[0])
    device = args.device
    rows = []
    for threads in thread_counts(args.threads, device):
        torch.set_num_threads(threads)
        for count in PARAM_COUNTS:
            rounds = args.rounds * 4 if count <= 200 else args.rounds * 2
            for kind in ("AdamW", "SGD"):
                for scaled in (False, True):
                    rows += measure(kind, count, scaled, device, rounds, threads)
    print(
        f"Host cost of one step over tiny params on {device}. 'time vs torch': fusedamp's median / "
        "torch's (target <= 0.6); 'round ratios': 10th-90th percentile of the per-round ratios"
    )
    print(format_table(rows, ["dtype", "op", "us", "time vs torch", "round ratios", "samples kept"]))
    checks = target_checks(rows)
    for line in checks:
        print(line)
    write_json(
        args.json, {"benchmark": "host", "environment": environment(device), "rows": rows, "targets": checks}
    )


if __name__ == "__main__":
    main()

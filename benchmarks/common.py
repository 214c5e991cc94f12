"""Timing helpers shared by the benchmarks: round-robin sampling, robust medians, copy
bandwidth as the yardstick, and the table / JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fusedamp


def benchmark_args(
    description: str, more: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """The options every benchmark takes: --device, --rounds, --threads, --json PATH; ``more``
    adds a module's own."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds per peer")
    parser.add_argument("--threads", default="", help="CPU thread counts to measure, e.g. 1,2 "
                        "(default: 1 and torch's default)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args()


def thread_counts(requested: str, device: str) -> list[int]:
    """The torch thread counts a CPU benchmark runs at (one pass at the default on a GPU)."""
    default = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return [default]
    if requested:
        return [int(count) for count in requested.split(",")]
    return sorted({1, default})


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    peers: dict[str, Callable[[], object]], device: str, rounds: int, warmup: int = 3, prepared: bool = False
) -> dict[str, list[float]]:
    """Seconds per call of every peer, ``rounds`` samples each (``prepared``: each peer is called
    untimed first and returns the call to time, so that its set-up stays out). The peers take
    turns, one call each per round, so that load from elsewhere on the machine hits all of them
    alike; the order rotates from round to round, so that no peer always runs right after the same
    one (a step that leaves megabytes of dirty cache lines slows whichever step comes next)."""
    samples: dict[str, list[float]] = {name: [] for name in peers}
    names = list(peers)
    for round_index in range(warmup + rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run = peers[name]() if prepared else peers[name]
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            if round_index >= warmup:
                samples[name].append(time.perf_counter() - start)
    return samples


def stable_medians(samples: dict[str, list[float]], disturbance: float = 1.5) -> tuple[dict[str, float], int]:
    """Median seconds per peer over its undisturbed samples, and the fewest samples any peer
    kept. Other load only ever adds time, so a sample over ``disturbance`` times the peer's
    best is one where the machine was busy elsewhere (on a shared machine, often most)."""
    medians, kept = {}, []
    for name, times in samples.items():
        clean = [t for t in times if t <= disturbance * min(times)]
        medians[name] = statistics.median(clean)
        kept.append(len(clean))
    return medians, min(kept)


def round_ratio_range(
    samples: dict[str, list[float]], numerator: str, denominator: str, disturbance: float = 1.5
) -> tuple[float, float] | None:
    """The 10th and 90th percentile (all of them under 10 rounds) of numerator's time / denominator's
    over the rounds where neither sample was disturbed (stable_medians' rule); None if no round was
    clean for both."""
    def clean(name: str) -> list[bool]:
        best = min(samples[name])
        return [t <= disturbance * best for t in samples[name]]

    ratios = sorted(
        a / b
        for a, b, ok_a, ok_b in zip(
            samples[numerator], samples[denominator], clean(numerator), clean(denominator), strict=True
        )
        if ok_a and ok_b
    )
    if not ratios:
        return None
    return ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]


def copy_peer(nbytes: int, device: str) -> tuple[Callable[[], object], int]:
    """A plain ``dst.copy_(src)`` of ``nbytes`` (the machine's streaming yardstick) and the
    bytes it moves (read + write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4


def gigabytes_per_second(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def environment(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "fusedamp": fusedamp.build_info(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_model() -> str:
    """The CPU's model name and its vector ISA level (avx512 / avx2 / none), as /proc/cpuinfo says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("flags")), []))
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    extras = [flag for flag in ("avx512_bf16", "amx_bf16", "avx512_fp16") if flag in flags]
    return f"{name} ({isa}{', ' + ', '.join(extras) if extras else ''})"


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` (floats with 2 decimals, None as n/a)."""

    def cell(value: Any) -> str:
        if value is None:
            return "n/a"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)

"""The headline table of a results file, as Markdown: what README.md and docs/performance.md
show, rendered from the JSON so that every figure there comes from a committed run.

    python -m benchmarks.summary benchmarks/results/cpu-avx512.json                # the steps
    python -m benchmarks.summary benchmarks/results/cpu-avx512.json --short        # README's rows
    python -m benchmarks.summary benchmarks/results/cpu-avx512.json --table host   # host cost
    python -m benchmarks.summary benchmarks/results/cpu-avx512.json --table bound  # L2 vs memory
    python -m benchmarks.summary benchmarks/results/cpu-avx512.json --table offload --threads 1
    python -m benchmarks.summary benchmarks/results/cpu-avx512.json --table offload-bound
    python -m benchmarks.summary benchmarks/results/cuda-h200.json --table gpu-status
    python -m benchmarks.summary --update README.md docs/performance.md   # every marked block

``steps``: one fusedamp step per row at the given thread count, its median time, and for each
peer the peer's time over fusedamp's (above 1x: fusedamp is faster) with, in brackets, the
10th-90th percentile of the per-round ratios where the module kept them. ``host``: the time of a
step over tiny params, fusedamp's over torch's (below 1x: fusedamp is faster). ``bound``: an
AdamW step's time per element with its data in L2 and from memory. ``offload``: the CPU step of a
GPT-2's params (bench_offload) by each implementation, with its host bytes per param and
fusedamp's ratios; ``offload-bound``: what bounds those steps. ``gpu-status``: a paragraph on
what ran on a GPU (a GPU results file's "tests").

A table whose run predates a change to the code it measures (:data:`MEASURES`, asked of git) gets
:data:`STALE_NOTE` under it. A results file records the commit it ran at (``environment.commit``);
one that joins two runs gives a module (``modules[i].commit``) or the demo (``demo.commit``) its own.
tests/test_docs.py checks every marked block, table and note, against what this renders.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Peers by their key in a row's "speedup", with the name the table gives them.
TORCH_FUSED = ("torch fused", "`AdamW(fused=True)`")
O2_RECIPE = ("torch O2 recipe", "torch's O2 recipe")
O2_FLAT = ("torch O2 recipe, flat", "the O2 recipe on flat buffers")
FP32_MOMENTS = ("fusedamp", "fusedamp's fp32-moment step")
FP32_MASTER = ("fusedamp", "fusedamp's fp32-master step")
EIGHT_BIT = [
    ("bitsandbytes AdamW8bit", "bitsandbytes `AdamW8bit`"),
    ("torchao AdamW8bit", "torchao `AdamW8bit`"),
]
# (label, bench, dtype, fusedamp's impl, peers)
ROWS = [
    ("AdamW, fp32 params", "adamw", "fp32", "fusedamp", [TORCH_FUSED, ("deepspeed", "DeepSpeedCPUAdam")]),
    ("AdamW, bf16 params + fp32 master", "adamw", "bf16", "fusedamp", [O2_RECIPE, O2_FLAT]),
    ('AdamW, bf16 params, `master_weights="remainder"`', "adamw", "bf16", "fusedamp remainder",
     [O2_RECIPE, O2_FLAT]),
    ('AdamW, fp32 params, `moments="int8"`', "adamw", "fp32", "fusedamp int8 moments",
     [FP32_MOMENTS, TORCH_FUSED, *EIGHT_BIT]),
    ('AdamW, fp32 params, `moments="bf16"`', "adamw", "fp32", "fusedamp bf16 moments",
     [FP32_MOMENTS, TORCH_FUSED]),
    ("AdamW, bf16 params, remainder + int8 moments", "adamw", "bf16", "fusedamp remainder int8",
     [FP32_MASTER, O2_FLAT]),
    ("AdamW, bf16 params, stochastic + int8 moments", "adamw", "bf16", "fusedamp stochastic int8",
     [FP32_MASTER, O2_FLAT]),
    ("SGD momentum, fp32 params", "sgd", "fp32", "fusedamp", [("torch fused", "`SGD(fused=True)`")]),
    ("SGD momentum, bf16 params + fp32 master", "sgd", "bf16", "fusedamp", [O2_RECIPE, O2_FLAT]),
]
SHORT = {0, 1, 2, 3, 5, 7}  # README's rows
UNSCALE = [
    ("`unscale_`", "fusedamp unscale_"),
    ("read-only check (the fused optimizer path)", "fusedamp check (read-only)"),
]
HEADER = "| step | fusedamp | peer's time / fusedamp's: median (10th-90th percentile of rounds) |"


def _find(rows: list[dict[str, Any]], bench: str, case: str, impl: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["bench"] == bench and r["case"] == case and r["impl"] == impl), None)


def _number(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _ratio(value: float) -> str:
    return _number(value) + "x"


def _spread(text: str) -> str:
    """A module's per-round range ("23.76-29.69") at the precision of its median."""
    low, high = (float(part) for part in text.split("-"))
    return f"{_number(low)}-{_number(high)}"


def table(results: dict[str, Any], threads: int = 2, short: bool = False, gpu: bool = False) -> list[str]:
    """The Markdown table's lines (header and separator included) for ``threads``, or (``gpu``) of
    the GPU's steps, whose cases name no thread count."""
    rows = results["rows"]
    lines = [HEADER, "| --- | --- | --- |"]
    for index, (label, bench, dtype, impl, peers) in enumerate(ROWS):
        if short and index not in SHORT:
            continue
        row = _find(rows, bench, dtype if gpu else f"{dtype}, {threads} threads", impl)
        if row is None:
            continue
        spread = row.get("speedup per round", {})
        cells = [
            f"{_ratio(row['speedup'][key])} {name}" + (f" ({_spread(spread[key])})" if key in spread else "")
            for key, name in peers
            if key in row.get("speedup", {})
        ]
        time_ms = f"{row['time_ms']:.2f}" if gpu else f"{row['time_ms']:.1f}"
        lines.append(f"| {label} | {time_ms} ms | {', '.join(cells)} |")
    if not short:
        for label, impl in UNSCALE:
            cases = [f"{dtype}, {threads} threads" for dtype in ("fp32", "fp16", "bf16")]
            found = [_find(rows, "unscale", case, impl) for case in cases]
            if all(found):
                times = " / ".join(f"{r['time_ms']:.1f}" for r in found)
                ratios = " / ".join(_ratio(r["vs torch unscale"]) for r in found)
                lines.append(f"| {label}, fp32 / fp16 / bf16 grads | {times} ms | {ratios} torch's unscale |")
    return lines


HOST_ROWS = [
    ("FusedAdamW vs `AdamW(fused=True)`", "AdamW step"),
    ("FusedAdamW + `fusedamp.GradScaler` vs + `torch.amp.GradScaler`", "AdamW step", " + GradScaler"),
    ("FusedSGD vs `SGD(fused=True)`", "SGD step"),
    ("FusedSGD + `fusedamp.GradScaler` vs + `torch.amp.GradScaler`", "SGD step", " + GradScaler"),
]


def host_table(results: dict[str, Any], threads: int = 1) -> list[str]:
    """bench_host's rows: fusedamp's time over torch's for a step over 200 and 2000 tiny params."""
    rows = results["rows"]
    lines = ["| step over params of 128 elements | 200 params | 2000 params |", "| --- | --- | --- |"]
    for label, step, *suffix in HOST_ROWS:
        cells = []
        for count in (200, 2000):
            case = f"{step}, {count} params of 128{''.join(suffix)}, {threads} threads"
            row = _find(rows, "host", case, "fusedamp")
            cells.append("-" if row is None else f"{_ratio(row['time vs torch'])} ({row['round ratios']})")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def bound_table(results: dict[str, Any]) -> list[str]:
    """bench_bound's rows: ns per element of an AdamW step on fp32 params, in L2 and from memory."""
    lines = ["| AdamW step, fp32 params | threads | in L2 | from memory |", "| --- | --- | --- | --- |"]
    for row in results["rows"]:
        if row["bench"] == "bound":
            l2, memory = row["in L2 ns"], row["from memory ns"]
            lines.append(f"| {row['impl']} | {row['threads']} | {l2:.2f} ns | {memory:.2f} ns |")
    return lines


# bench_offload's rows: (bench, impl, label).
OFFLOAD_ROWS = [
    ("offload adamw", "deepspeed", "DeepSpeedCPUAdam, fp32"),
    ("offload adamw", "torch fused", "`AdamW(fused=True)`, fp32"),
    ("offload adamw", "fusedamp", "FusedAdamW, fp32"),
    ("offload adamw", "fusedamp bf16 remainder int8", 'FusedAdamW, bf16, `"remainder"`, int8 moments'),
    ("offload adamw", "fusedamp bf16 stochastic int8", 'FusedAdamW, bf16, `"stochastic"`, int8 moments'),
    ("offload sgd", "torch fused", "`SGD(fused=True)`, fp32, momentum"),
    ("offload sgd", "fusedamp", "FusedSGD, fp32, momentum"),
]
OFFLOAD_PEERS = {"deepspeed": "DeepSpeedCPUAdam", "torch fused": "torch fused", "fusedamp": "FusedAdamW fp32"}


def _offload_row(rows: list[dict[str, Any]], bench: str, impl: str, threads: int) -> dict[str, Any] | None:
    return next(
        (r for r in rows if r["bench"] == bench and r["impl"] == impl and r.get("threads") == threads), None
    )


def offload_table(results: dict[str, Any], threads: int = 1) -> list[str]:
    """bench_offload's rows at ``threads``: ms per million params, GB/s of the job's bytes (% of the
    in-place stream rate of the same rounds), host bytes per param, and for fusedamp's rows the
    peers' time over fusedamp's (at another precision: marked so)."""
    lines = [
        "| step, GPT-2 124M params on the CPU | ms per M params | GB/s (% of stream) | host B/param "
        "| peer's time / fusedamp's: median (10th-90th percentile of rounds) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for bench, impl, label in OFFLOAD_ROWS:
        row = _offload_row(results["rows"], bench, impl, threads)
        if row is None:
            continue
        cells = []
        for key, prefix in (("speedup", ""), ("speedup, other precision", "other precision: ")):
            spread = row.get(f"{key} per round", {})
            ratios = [
                f"{_ratio(ratio)} {OFFLOAD_PEERS[peer]}"
                + (f" ({_spread(spread[peer])})" if spread.get(peer, "n/a") != "n/a" else "")
                for peer, ratio in row.get(key, {}).items()
            ]
            if ratios:
                cells.append(prefix + ", ".join(ratios))
        lines.append(
            f"| {label} | {row['ms per Mparam']:.2f} | {row['gbps']:.1f} ({row['% stream']:.0f}%) "
            f"| {row['host B/param']:.2f} | {'; '.join(cells) or '-'} |"
        )
    return lines


def _ns(value: float | None) -> str:
    """A time in ns, or n/a where the run could not measure it (None; a slope at or below 0 in
    runs before bench_offload recorded None)."""
    return "n/a" if value is None or value <= 0 else f"{value:.2f} ns"


def offload_bound_table(results: dict[str, Any]) -> list[str]:
    """bench_offload's bound: per param, each fp32 step's time from memory, its bytes at the copy and
    in-place stream rates of the same rounds, and its time with the data in L2."""
    lines = [
        "| step, fp32 | threads | from memory | bytes at copy / stream rate | in L2 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for threads in sorted({row["threads"] for row in results["rows"] if row["bench"].startswith("offload")}):
        for bench, impl, label in OFFLOAD_ROWS:
            row = _offload_row(results["rows"], bench, impl, threads)
            if row is None or "bf16" in impl:
                continue
            lines.append(
                f"| {label.replace(', fp32', '')} | {threads} | {row['from memory ns']:.2f} ns "
                f"| {row['copy bound ns']:.2f} / {row['stream bound ns']:.2f} ns | {_ns(row['in L2 ns'])} |"
            )
    return lines


def gpu_bandwidth_table(results: dict[str, Any]) -> list[str]:
    """The GPU's memory-bound ops: time, GB/s and % of the copy bandwidth measured in the same
    run, and torch's time over fusedamp's where torch has the op."""
    lines = [
        "| op | dtype | ms | GB/s | % of copy | torch's time / fusedamp's |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        fusedamp = row["impl"].startswith("fusedamp")
        if row["bench"] != "unscale" or row.get("device") != "cuda" or not fusedamp:
            continue
        versus = next((v for k, v in row.items() if k.startswith("vs torch")), None)
        lines.append(
            f"| {row['impl'].removeprefix('fusedamp ')} | {row['case']} | {row['time_ms']:.3f} "
            f"| {row['gbps']:,.0f} | {100 * row['fraction_of_ceiling_gbps']:.0f}% "
            f"| {_ratio(versus) if versus else 'no torch op'} |"
        )
    return lines


def gemm_table(results: dict[str, Any]) -> list[str]:
    """bench_gemm's rows: torch.matmul's TFLOP/s and each fusedamp kernel's share of it."""
    lines = [
        "| shape | dtype | torch TFLOP/s | wgmma | mma.sync | with bias + GELU: torch | wgmma | mma.sync |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [r for r in results["rows"] if r["bench"] == "gemm"]
    for case in dict.fromkeys(r["case"] for r in rows if not r["case"].endswith("+bias+gelu")):
        cells = []
        for variant in (case, case + " +bias+gelu"):
            torch_row = _find(rows, "gemm", variant, "torch")
            cells.append(f"{torch_row['tflops']:.0f}")
            for impl in ("fusedamp", "fusedamp-mma_sync"):
                cells.append(f"{_find(rows, 'gemm', variant, impl)['tflops'] / torch_row['tflops']:.2f}x")
        shape, dtype = case.rsplit(" ", 1)
        lines.append(f"| {shape} | {dtype} | " + " | ".join(cells) + " |")
    return lines


def muon_table(results: dict[str, Any]) -> list[str]:
    """bench_muon's rows: FusedMuon's step, torch.optim.Muon's time over it, and the step with int8
    momentum (fp32 params) at each thread count (CPU) or on the GPU."""
    lines = [
        "| params | CPU threads / GPU | FusedMuon | `torch.optim.Muon` | FusedMuon, int8 momentum |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows = [r for r in results["rows"] if r["bench"] == "muon"]
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, theirs = _find(rows, "muon", case, "fusedamp"), _find(rows, "muon", case, "torch")
        if ours is None or theirs is None:
            continue
        coded = _find(rows, "muon", case, "fusedamp int8 momentum")
        fp32 = case.startswith("fp32")
        params = "fp32" if fp32 else "bf16 (FusedMuon: remainder master, int8 momentum)"
        gpu = ours.get("device") == "cuda"
        threads = "GPU" if gpu else str(ours["threads"])
        versus = f"{theirs['time_ms'] / ours['time_ms']:.2f}x ({_spread(theirs['ratio spread (p10-p90)'])})"
        digits = 2 if gpu else 1
        int8 = f"{coded['time_ms']:.{digits}f} ms" if coded else "-"
        lines.append(f"| {params} | {threads} | {ours['time_ms']:.{digits}f} ms | {versus} | {int8} |")
    return lines


def offload_loop_table(results: dict[str, Any]) -> list[str]:
    """bench_offload_loop's rows: the training step, where its time goes (GPU timeline, host work,
    copies), host and GPU bytes per param. Results from before that breakdown (a "step alone"
    per row, the committed cuda-h200.json's) keep their own columns."""
    rows = [row for row in results["rows"] if row["bench"] == "offload-loop"]
    if any("step_alone_ms" in row for row in rows):
        lines = [
            "| training step | optimizer | ms per step | forward + backward | step alone | exposed "
            "| host B/param |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in rows:
            host = row.get("host_bytes_per_param")
            lines.append(
                f"| {row['case']} | {row['impl']} | {row['time_ms']:.1f} | {row['fwd_bwd_ms']:.1f} "
                f"| {row['step_alone_ms']:.1f} | {row['exposed_ms']:.1f} | {f'{host:.2f}' if host else '-'} |"
            )
        return lines

    def cell(row: dict[str, Any], key: str, digits: int = 1) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| model | optimizer | ms per step | forward | backward | step | hooks (host) | CPU step (host) "
        "| D2H | H2D | host B/param | GPU peak B/param |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if not row.get("fits", True):
            lines.append(f"| {row['case']} | {row['impl']} | out of memory |" + " - |" * 9)
            continue
        lines.append(
            f"| {row['case']} | {row['impl']} | {cell(row, 'time_ms')} | {cell(row, 'forward_ms')} "
            f"| {cell(row, 'backward_ms')} | {cell(row, 'step_ms')} | {cell(row, 'hooks_ms')} "
            f"| {cell(row, 'cpu_step_ms')} | {cell(row, 'd2h_ms')} | {cell(row, 'h2d_ms')} "
            f"| {cell(row, 'host_bytes_per_param', 2)} | {cell(row, 'gpu_peak_bytes_per_param', 2)} |"
        )
    return lines


def demo_table(results: dict[str, Any]) -> list[str]:
    """The demo's speedups over fp32, optimizer steps and test accuracies."""
    lines = [
        "| demo mode | speedup over fp32 | optimizer step (ms) | test accuracy |",
        "| --- | --- | --- | --- |",
    ]
    for mode in results["demo"]["modes"]:
        lines.append(
            f"| {mode['mode']} | {mode['speedup_vs_fp32']:.2f}x | {mode['optimizer_step_ms']:.2f} "
            f"| {100 * mode['accuracy']:.2f}% |"
        )
    return lines


def render(
    results: dict[str, Any], kind: str = "steps", threads: int | None = None, short: bool = False
) -> list[str]:
    """The table ``kind`` (steps, host, bound, offload, offload-bound, muon; on a GPU: gpu-steps,
    gpu-bandwidth, gemm, offload-loop, demo, and gpu-status, a paragraph) of ``results``."""
    gpu_tables = {"gpu-steps": lambda results: table(results, gpu=True), "gpu-bandwidth": gpu_bandwidth_table,
                  "gemm": gemm_table, "offload-loop": offload_loop_table, "demo": demo_table,
                  "gpu-status": gpu_status}
    if kind in gpu_tables:
        return gpu_tables[kind](results)
    if kind == "host":
        return host_table(results, threads or 1)
    if kind == "bound":
        return bound_table(results)
    if kind == "muon":
        return muon_table(results)
    if kind == "offload":
        return offload_table(results, threads or 1)
    if kind == "offload-bound":
        return offload_bound_table(results)
    return table(results, threads or 2, short)


# --- What the GPU run covered, and figures older than their code --------------------------------

# The library sources whose changes can move a table's figures (git pathspecs from the repository's
# root): the kernels of its device and the Python around them, and setup.py's compile flags.
_NOT_GEMM = (":(exclude)csrc/cuda/gemm", ":(exclude)csrc/ops/gemm.*", ":(exclude)csrc/include/fusedamp/gemm")
_STEP_PYTHON = ("setup.py", "fusedamp/optim", "fusedamp/grad_scaler.py", "fusedamp/ops.py")
CPU_STEP_SOURCES = ("csrc", ":(exclude)csrc/cuda", ":(exclude)*.md", *_NOT_GEMM, *_STEP_PYTHON)
CUDA_STEP_SOURCES = ("csrc", ":(exclude)csrc/cpu", ":(exclude)*.md", *_NOT_GEMM, *_STEP_PYTHON)
OFFLOAD_LOOP_SOURCES = ("csrc", ":(exclude)*.md", *_NOT_GEMM, *_STEP_PYTHON)
GEMM_SOURCES = ("setup.py", "csrc/cuda/gemm", "csrc/ops/gemm.*", "csrc/include/fusedamp/gemm",
                "fusedamp/ops.py", "fusedamp/nn")
DEMO_SOURCES = (*OFFLOAD_LOOP_SOURCES, "fusedamp")
# table kind: (the modules whose rows it shows, or "demo"; its sources on a CPU, on a GPU)
MEASURES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "steps": (("bench_optim", "bench_unscale"), CPU_STEP_SOURCES, CUDA_STEP_SOURCES),
    "host": (("bench_host",), CPU_STEP_SOURCES, CUDA_STEP_SOURCES),
    "bound": (("bench_bound",), CPU_STEP_SOURCES, CUDA_STEP_SOURCES),
    "offload": (("bench_offload",), CPU_STEP_SOURCES, CPU_STEP_SOURCES),
    "offload-bound": (("bench_offload",), CPU_STEP_SOURCES, CPU_STEP_SOURCES),
    "muon": (("bench_muon",), CPU_STEP_SOURCES, CUDA_STEP_SOURCES),
    "gpu-steps": (("bench_optim",), CUDA_STEP_SOURCES, CUDA_STEP_SOURCES),
    "gpu-bandwidth": (("bench_unscale",), CUDA_STEP_SOURCES, CUDA_STEP_SOURCES),
    "gemm": (("bench_gemm",), GEMM_SOURCES, GEMM_SOURCES),
    "offload-loop": (("bench_offload_loop",), OFFLOAD_LOOP_SOURCES, OFFLOAD_LOOP_SOURCES),
    "demo": (("demo",), DEMO_SOURCES, DEMO_SOURCES),
}
STALE_NOTE = "*Measured before the latest changes to the code these figures measure: they may differ now.*"


def changed_since(commit: str, sources: Sequence[str], root: Path = ROOT) -> bool | None:
    """Whether any of ``sources`` changed after ``commit``: in a commit since (on the way to HEAD)
    or in the work tree. None when git cannot tell: no git, not a checkout, a commit it lacks (a
    shallow clone). A commit recorded as ``-dirty`` counts as the commit itself."""
    commands = (["log", "--format=%h", f"{commit.removesuffix('-dirty')}..HEAD"], ["status", "--porcelain"])
    found = []
    for command in commands:
        try:
            done = subprocess.run(["git", *command, "--", *sources], cwd=root, capture_output=True, text=True,
                                  timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        found.append(done.stdout.strip())
    return any(found)


def _commit_of(results: dict[str, Any], module: str) -> str:
    """The commit a module's rows were measured at: its own where a results file joins two runs."""
    if module == "demo":
        own = results["demo"].get("commit")
    else:
        own = next((m.get("commit") for m in results.get("modules", []) if m["module"] == module), None)
    return own or results["environment"]["commit"]


def note(results: dict[str, Any], kind: str = "steps", root: Path = ROOT) -> str | None:
    """The line under the table ``kind`` of ``results``: :data:`STALE_NOTE` when the code it measures
    changed after its run, "" when not, None when git cannot tell. For gpu-status: what changed since
    the GPU run without running on a GPU again."""
    if kind == "gpu-status":
        return _gpu_status_note(results, root)
    modules, cpu_sources, gpu_sources = MEASURES[kind]
    sources = gpu_sources if results["platform"].startswith("cuda") else cpu_sources
    changed = [changed_since(_commit_of(results, module), sources, root) for module in modules]
    if None in changed:
        return None
    return STALE_NOTE if any(changed) else ""


def _passed(counts: dict[str, Any]) -> int:
    return counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]


def gpu_status(results: dict[str, Any]) -> list[str]:
    """One paragraph: on which GPU the CUDA kernels ran, the code of which arch, at which commits, and
    what the tests and compute-sanitizer found (a GPU results file's "tests")."""
    environment, tests = results["environment"], results["tests"]
    archs = environment["build_info"]["cuda_archs"]
    ran = next(arch for arch in archs if arch.rstrip("a") == environment["capability"])
    cuda, gemm, sanitizer = tests["cuda_tests"], tests["gemm_tests"], tests["sanitizer"]
    text = (
        f"The CUDA kernels have run on one GPU, an {environment['processor']}: its sm_{ran.replace('.', '')} "
        f"code, built for `{';'.join(archs)}`, with torch {environment['torch']}. At {cuda['commit']}, "
        f"{_passed(cuda)} of {cuda['tests']} CUDA tests passed ({cuda['note']}); at {gemm['commit']}, "
        f"{_passed(gemm)} of {gemm['tests']} GEMM tests passed ({gemm['note']}); at {sanitizer['commit']}, "
        f"compute-sanitizer's memcheck and initcheck found {sanitizer['errors']} errors in "
        f"{sanitizer['subset']}. No other GPU, and no code built for another arch, has run."
    )
    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False)


def _gpu_status_note(results: dict[str, Any], root: Path) -> str | None:
    tests = results["tests"]
    families = [
        ("the AMP and optimizer kernels", CUDA_STEP_SOURCES, tests["cuda_tests"]["commit"]),
        ("the GEMM kernels", GEMM_SOURCES, tests["gemm_tests"]["commit"]),
    ]
    changed = {name: changed_since(commit, sources, root) for name, sources, commit in families}
    if None in changed.values():
        return None
    names = [name for name, was_changed in changed.items() if was_changed]
    if not names:
        return ""
    changed = " and of ".join(names)
    return f"*Changed since those runs, and not run on a GPU since: the sources or build of {changed}.*"


NOTE_PREFIXES = (STALE_NOTE, "*Changed since those runs")
MARKER = re.compile(r"^<!-- python -m benchmarks\.summary (\S+)(.*) -->$")


def updated_lines(lines: list[str], root: Path = ROOT) -> list[str]:
    """``lines`` (a Markdown file's) with every block under a marker line rendered again from its
    results file: the table or paragraph (up to the next blank line) and its note (a blank line
    and :func:`note`'s line, where not empty). Where git cannot tell, a note stays as it was."""
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        found = MARKER.match(line)
        if not found:
            continue
        options = found.group(2).split()
        kind = options[options.index("--table") + 1] if "--table" in options else "steps"
        threads = int(options[options.index("--threads") + 1]) if "--threads" in options else None
        results = json.loads((root / found.group(1)).read_text())
        out.extend(render(results, kind, threads, "--short" in options))
        while index < len(lines) and lines[index].strip():
            index += 1
        old_note = None
        if index + 1 < len(lines) and not lines[index].strip() and lines[index + 1].startswith(NOTE_PREFIXES):
            old_note = lines[index + 1]
            index += 2
        new_note = note(results, kind, root)
        if new_note is None:
            new_note = old_note
        if new_note:
            out.extend(["", new_note])
    return out


def marker(path: str, kind: str = "steps", threads: int | None = None, short: bool = False) -> str:
    """The comment line above a rendered table: the command that renders it again (tests/test_docs.py
    checks every table under such a line against its JSON)."""
    options = (f" --table {kind}" if kind != "steps" else "") + (f" --threads {threads}" if threads else "")
    return f"<!-- python -m benchmarks.summary {path}{options}{' --short' if short else ''} -->"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", help="a benchmarks/results/<platform>.json")
    tables = ("steps", "host", "bound", "offload", "offload-bound", "muon",
              "gpu-steps", "gpu-bandwidth", "gemm", "offload-loop", "demo", "gpu-status")
    parser.add_argument("--table", choices=tables, default="steps")
    parser.add_argument(
        "--threads", type=int, default=None, help="default: 2 for steps, 1 for host and offload"
    )
    parser.add_argument("--short", action="store_true", help="README's rows only")
    parser.add_argument("--update", nargs="+", type=Path, metavar="FILE.md",
                        help="render every marked block of these files again, in place")
    args = parser.parse_args(argv)
    if args.update:
        for path in args.update:
            text = path.read_text()
            updated = "\n".join(updated_lines(text.splitlines())) + "\n"
            if updated != text:
                path.write_text(updated)
                print(f"updated {path}")
        return
    if args.results is None:
        parser.error("a results file, or --update FILE.md")
    results = json.loads(Path(args.results).read_text())
    print(marker(args.results, args.table, args.threads, args.short))
    print("\n".join(render(results, args.table, args.threads, args.short)))
    found = note(results, args.table)
    if found:
        print(f"\n{found}")


if __name__ == "__main__":
    main()

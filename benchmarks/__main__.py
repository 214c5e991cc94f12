"""One command for every microbenchmark: ``python -m benchmarks`` (or ``make bench``).

Runs each ``benchmarks/bench_*.py`` module in its own process as
``python -m benchmarks.bench_<name> --json ROWS.json``, then prints one table with the ratios
against the peers and writes the combined JSON to ``benchmarks/results/<platform>.json``
(``cpu-avx512``, ``cpu-avx2``, ``cuda-h200``, ...), replacing the previous run's. The JSON
records the date, commit, CPU or GPU, torch, threads and command. ``--plot`` also draws the
achieved GB/s and TFLOP/s against the ceilings measured in the same run, into ``out/`` (ignored
by git): charts are drawn on the reader's machine, not committed.

Contract for a ``bench_*.py`` module
------------------------------------
- It accepts ``--json PATH`` and writes there a JSON list of rows (a ``{"rows": [...]}``
  object is accepted too); it may print whatever it likes.
- It may add ``"targets"``, a list of one-line verdicts on its targets, to a ``{"rows": ...}``
  object: they are printed after the table and kept in the combined JSON.
- It decides itself what this machine supports. When it supports nothing (GEMM without a
  GPU), it exits with status 77 after printing why, or writes an empty list. Any other
  non-zero status counts as a failure: the others still run, and the command exits with 1.

Row format (one dict per measurement; keys beyond these are kept in the JSON as they are):

=================  ======  ==========================================================
key                type    meaning
=================  ======  ==========================================================
``bench``          str     family, e.g. ``"unscale"``, ``"adamw"``, ``"gemm"``
                           (default: the module name without ``bench_``)
``case``           str     what was measured, e.g. ``"bf16 params + fp32 master, 64M"``
``impl``           str     who ran it: ``"fusedamp"`` or a peer (``"torch"``,
                           ``"torch-recipe"``, ``"cublas"``, ...)
``time_ms``        float   time of one call (median of the repeats)
``device``         str     ``"cpu"`` or ``"cuda"`` (optional)
``gbps``           float   achieved bandwidth: modelled bytes moved / time (optional)
``tflops``         float   achieved compute: 2*M*N*K / time, etc. (optional)
``ceiling_gbps``   float   bandwidth ceiling measured in the same run, e.g. the device's
                           copy bandwidth (optional)
``ceiling_tflops`` float   compute ceiling measured in the same run (optional)
=================  ======  ==========================================================

Rows with the same ``(bench, case, device)`` are compared: each peer row shows how many times
faster the ``fusedamp`` row of its group is (peer time / fusedamp time).

Also understood, so that table-style modules need no adapter: ``ms``, ``GB/s``, ``TFLOP/s`` and
``op`` for ``time_ms``, ``gbps``, ``tflops`` and ``impl``; a ``dtype`` key as the ``case``; a
top-level ``"benchmark"`` name as ``bench``; a row whose impl is ``copy`` as the bandwidth
ceiling of its group; and ratios the module computed itself, in keys starting with ``vs ``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
SKIP_STATUS = 77  # the automake/ctest convention for "not applicable here"


@dataclass
class ModuleRun:
    """The outcome of one benchmark module: ``status`` is "ok", "skipped" or "failed"."""

    module: str
    status: str
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    targets: list[str] = field(default_factory=list)  # the module's verdicts on its targets


def discover(package_dir: str = PACKAGE_DIR) -> list[str]:
    """Names of the ``bench_*.py`` modules in ``package_dir``, sorted."""
    return sorted(
        name[:-3] for name in os.listdir(package_dir)
        if name.startswith("bench_") and name.endswith(".py")
    )


def _last_lines(text: str, count: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


def run_module(module: str, package_dir: str = PACKAGE_DIR, timeout: float = 900.0) -> ModuleRun:
    """Runs ``module`` of the package at ``package_dir`` in a fresh process and reads its rows."""
    package = os.path.basename(package_dir)
    with tempfile.TemporaryDirectory() as scratch:
        rows_path = os.path.join(scratch, "rows.json")
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", f"{package}.{module}", "--json", rows_path],
                cwd=os.path.dirname(package_dir), capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return ModuleRun(module, "failed", time.perf_counter() - start,
                             message=f"timed out after {timeout:.0f} s")
        seconds = time.perf_counter() - start
        output = done.stdout + done.stderr
        if done.returncode == SKIP_STATUS:
            return ModuleRun(module, "skipped", seconds, message=_last_lines(output, 1))
        if done.returncode != 0:
            return ModuleRun(module, "failed", seconds,
                             message=f"exit status {done.returncode}:\n{_last_lines(output)}")
        if not os.path.exists(rows_path):
            return ModuleRun(module, "failed", seconds, message=f"wrote no {rows_path} for --json")
        try:
            with open(rows_path) as rows_file:
                loaded = json.load(rows_file)
        except json.JSONDecodeError as error:
            return ModuleRun(module, "failed", seconds, message=f"--json output is not JSON: {error}")
    rows = loaded.get("rows", []) if isinstance(loaded, dict) else loaded
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return ModuleRun(module, "failed", seconds, message="--json output is not a list of row dicts")
    if not rows:
        return ModuleRun(module, "skipped", seconds, message=_last_lines(output, 1) or "no rows")
    bench = loaded.get("benchmark") if isinstance(loaded, dict) else None
    device = loaded.get("environment", {}).get("device", "") if isinstance(loaded, dict) else ""
    targets = loaded.get("targets", []) if isinstance(loaded, dict) else []
    return ModuleRun(module, "ok", seconds,
                     [normalize_row(row, bench or module.removeprefix("bench_"), device) for row in rows],
                     targets=[str(line) for line in targets])


_ALIASES = {"time_ms": "ms", "gbps": "GB/s", "tflops": "TFLOP/s", "impl": "op", "case": "dtype"}


def normalize_row(row: dict[str, Any], bench: str, device: str = "") -> dict[str, Any]:
    """``row`` with the documented keys filled in from their aliases and defaults."""
    normalized = dict(row)
    for key, alias in _ALIASES.items():
        if normalized.get(key) is None and row.get(alias) is not None:
            normalized[key] = row[alias]
    normalized.setdefault("bench", bench)
    normalized.setdefault("device", device)
    normalized.setdefault("case", "")
    normalized.setdefault("impl", "")
    return normalized


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Sets ``ceiling_gbps`` from the group's ``copy`` row where a row has none,
    ``fusedamp_speedup`` (peer time / fusedamp time) on every peer row whose group has a
    fusedamp row, and ``fraction_of_ceiling_*`` where a row has a rate and its ceiling."""
    copy_rate = {
        (row["bench"], row["case"], row["device"]): row["gbps"]
        for row in rows if row["impl"] == "copy" and row.get("gbps")
    }
    for row in rows:
        if row["impl"] != "copy" and not row.get("ceiling_gbps"):
            row["ceiling_gbps"] = copy_rate.get((row["bench"], row["case"], row["device"]))
    fusedamp_time = {
        (row["bench"], row["case"], row["device"]): row["time_ms"]
        for row in rows if row["impl"] == "fusedamp" and row.get("time_ms")
    }
    for row in rows:
        reference = fusedamp_time.get((row["bench"], row["case"], row["device"]))
        if row["impl"] != "fusedamp" and reference and row.get("time_ms"):
            row["fusedamp_speedup"] = row["time_ms"] / reference
        for rate, ceiling in (("gbps", "ceiling_gbps"), ("tflops", "ceiling_tflops")):
            if row.get(rate) and row.get(ceiling):
                row[f"fraction_of_{ceiling}"] = row[rate] / row[ceiling]


def _number(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """All rows as one aligned text table."""
    header = ["bench", "case", "device", "impl", "time ms", "GB/s", "% ceil", "TFLOP/s", "% ceil",
              "fusedamp speedup", "module's ratios"]
    lines = [header]
    for row in rows:
        gb_fraction = row.get("fraction_of_ceiling_gbps")
        tf_fraction = row.get("fraction_of_ceiling_tflops")
        speedup = row.get("fusedamp_speedup")
        ratios = ", ".join(f"{key} {value:.2f}x" for key, value in row.items()
                           if key.startswith("vs ") and isinstance(value, (int, float)))
        lines.append([
            str(row["bench"]), str(row["case"]), str(row["device"]), str(row["impl"]),
            _number(row.get("time_ms"), 3), _number(row.get("gbps")),
            "-" if gb_fraction is None else f"{gb_fraction:.0%}", _number(row.get("tflops"), 2),
            "-" if tf_fraction is None else f"{tf_fraction:.0%}",
            "-" if speedup is None else f"{speedup:.2f}x", ratios or "-",
        ])
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = ["  ".join(cell.ljust(w) if c < 4 or c == len(header) - 1 else cell.rjust(w)
                      for c, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def plot_rows(rows: list[dict[str, Any]], path: str, title: str) -> bool:
    """Horizontal bars of achieved GB/s and TFLOP/s, each with its measured ceiling marked.
    Returns False (and draws nothing) when matplotlib is missing or no row has a rate."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(unit, key, [row for row in rows if row.get(key)])
              for unit, key in (("GB/s", "gbps"), ("TFLOP/s", "tflops"))]
    panels = [panel for panel in panels if panel[2]]
    if not panels:
        return False
    height = max(3.0, 0.3 * max(len(panel_rows) for _, _, panel_rows in panels) + 1.5)
    figure, axes_list = plt.subplots(1, len(panels), figsize=(8 * len(panels), height), squeeze=False)
    for axes, (unit, key, panel_rows) in zip(axes_list[0], panels, strict=True):
        labels = [f"{row['bench']} {row['case']} [{row['impl']}]" for row in panel_rows]
        positions = range(len(panel_rows))
        colors = ["tab:green" if row["impl"].startswith("fusedamp") else "tab:gray" for row in panel_rows]
        axes.barh(positions, [row[key] for row in panel_rows], color=colors)
        ceilings = [(p, row.get(f"ceiling_{key}")) for p, row in zip(positions, panel_rows, strict=True)]
        ceilings = [(p, c) for p, c in ceilings if c]
        if ceilings:
            axes.scatter([c for _, c in ceilings], [p for p, _ in ceilings], marker="|", s=400,
                         color="black", label="ceiling measured in this run")
            axes.legend(loc="lower right")
        axes.set_yticks(list(positions), labels, fontsize=8)
        axes.invert_yaxis()
        axes.set_xlabel(f"achieved {unit} (green: fusedamp, gray: peers)")
        axes.grid(axis="x", alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def platform_name() -> str:
    """The results file's name: ``cuda-<gpu>`` when there is a GPU (``cuda-h200``), else
    ``cpu-<isa>`` with the ISA build of fusedamp's CPU kernels that runs (``cpu-avx512``,
    ``cpu-avx2``; ``FUSEDAMP_CPU_ISA=avx2`` picks the AVX2 build on an AVX-512 machine).
    Non-x86 CPUs get their architecture too (``cpu-aarch64-baseline``)."""
    if torch.cuda.is_available():
        return "cuda-" + _slug(torch.cuda.get_device_name().removeprefix("NVIDIA "))
    try:
        import fusedamp

        isa = fusedamp.build_info()["cpu_isa"]
    except Exception:  # the name must not depend on the extension importing
        isa = torch.backends.cpu.get_cpu_capability()
    machine = platform.machine().lower()
    prefix = "cpu" if machine in ("x86_64", "amd64") else f"cpu-{machine}"
    return f"{prefix}-{_slug(isa)}"


def _command_output(*args: str) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=PACKAGE_DIR)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _processor() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The environment settings that change what a run measures (the kernels' ISA and prefetch
# distance, the ISA torch and oneDNN dispatch to, the threads, the GPUs): recorded in front of the
# run's command. Build settings are not: the build's choices are in build_info.
RECORDED_SETTINGS = (
    "FUSEDAMP_CPU_ISA",
    "FUSEDAMP_CPU_PREFETCH",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


def command_line(argv: list[str], settings: dict[str, str] | None = None) -> str:
    """The command that reproduces a run: the RECORDED_SETTINGS it ran under, then
    ``python -m benchmarks`` with ``argv``."""
    settings = os.environ if settings is None else settings
    names = sorted(name for name in RECORDED_SETTINGS if name in settings)
    recorded = [f"{name}={shlex.quote(settings[name])}" for name in names]
    return " ".join([*recorded, "python -m benchmarks", *map(shlex.quote, argv)])


def environment(argv: list[str]) -> dict[str, Any]:
    """The conditions of a run, saved with its rows: what performance pages quote as a header."""
    try:
        import fusedamp

        build: Any = fusedamp.build_info()
    except Exception as error:
        build = repr(error)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _command_output("git", "describe", "--always", "--dirty", "--abbrev=7"),
        "processor": _processor(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command_line(argv),
        "build_info": build,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmarks and returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="",
                        help="comma-separated module names (bench_unscale or unscale) to run")
    parser.add_argument("--results-dir", default=os.path.join(PACKAGE_DIR, "results"), metavar="DIR",
                        help="where <platform>.json is written, replacing the last run's "
                        "(default: benchmarks/results)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the combined results here instead of DIR/<platform>.json")
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="FILE.png",
                        help="also draw GB/s and TFLOP/s against the ceilings (needs matplotlib; "
                        "default file: out/<platform>.png, ignored by git)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per module")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    modules = discover()
    if args.only:
        wanted = {name if name.startswith("bench_") else f"bench_{name}" for name in args.only.split(",")}
        unknown = wanted - set(modules)
        if unknown:
            parser.error(f"no such benchmark modules: {sorted(unknown)}; found {modules}")
        modules = [m for m in modules if m in wanted]
    if not modules:
        print(f"no benchmarks/bench_*.py modules in {PACKAGE_DIR}")
        return 1

    runs = []
    for module in modules:
        print(f"running {module} ...", flush=True)
        run = run_module(module, timeout=args.timeout)
        note = f"{len(run.rows)} rows" if run.status == "ok" else run.message
        print(f"  {run.status} in {run.seconds:.1f} s: {note}", flush=True)
        runs.append(run)
    rows = [row for run in runs for row in run.rows]
    add_ratios(rows)
    if rows:
        print()
        print(format_table(rows))
    targets = [line for run in runs for line in run.targets]
    if targets:
        print("\ntargets:\n" + "\n".join(targets))

    name = platform_name()
    json_path = args.json or os.path.join(args.results_dir, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as out:
        json.dump({
            "platform": name, "environment": environment(argv),
            "modules": [{"module": r.module, "status": r.status, "seconds": r.seconds,
                         "message": r.message, "targets": r.targets} for r in runs],
            "rows": rows,
        }, out, indent=1, default=str)
        out.write("\n")
    print(f"\nresults written to {json_path}")
    if args.plot is not None:
        plot_path = args.plot or os.path.join(os.path.dirname(PACKAGE_DIR), "out", f"{name}.png")
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        if plot_rows(rows, plot_path, f"fusedamp microbenchmarks on {name}"):
            print(f"plot written to {plot_path}")
        else:
            print("no plot: it needs matplotlib (`pip install matplotlib`) and rows with gbps or tflops")
    return 1 if any(run.status == "failed" for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fails on register spills in any CUDA kernel or on ptxas wgmma serialization warnings (C7510,
C7511). Needs nvcc and torch, no GPU. Either compiles every CUDA source with ``-Xptxas -v``, or
reads the log of a full build made with FUSEDAMP_PTXAS_VERBOSE=1 (what CI does: one compile).

    python -m tools.check_ptxas                 # archs 8.0;9.0a, or TORCH_CUDA_ARCH_LIST
    python -m tools.check_ptxas --jobs 2 --json out/ptxas.json
    FUSEDAMP_PTXAS_VERBOSE=1 make build 2>&1 | tee build.log
    python -m tools.check_ptxas --log build.log  # from a build from scratch
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "csrc" / "cuda").rglob("*.cu"))
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SERIALIZATION = re.compile(r"C751[01]|wgmma[^\n]*serializ", re.IGNORECASE)
# A build step in ninja's output: "[3/12] <command>", the step's own output on the lines after it.
NINJA_STEP = re.compile(r"^\[\d+/\d+\] (.*)$")


def find_nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("check_ptxas: nvcc not found; set CUDA_HOME or put nvcc on PATH")
    # nvcc on PATH may be a wrapper script: use the toolkit it runs.
    dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True,
                         text=True)
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    return str(Path(top.group(1).strip()) / "bin" / "nvcc") if top else nvcc


def nvcc_command(nvcc: str, source: Path, archs: list[str], out: Path) -> list[str]:
    # cpp_extension guesses the toolkit when imported; tell it the one nvcc belongs to.
    os.environ.setdefault("CUDA_HOME", str(Path(nvcc).parent.parent))
    import torch.utils.cpp_extension as ext

    includes = [ROOT / "csrc" / "include", ROOT / "csrc", *ext.include_paths()]
    gencode = []
    for arch in archs:
        number = arch.replace(".", "")
        gencode.append(f"-gencode=arch=compute_{number},code=sm_{number}")
    return [
        nvcc, "-c", str(source), "-o", str(out), *(f"-I{p}" for p in includes),
        "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        "--fmad=false", "-DFUSEDAMP_WITH_CUDA=1", "-Xptxas=-v", *gencode,
    ]


def parse(report: str) -> list[dict[str, object]]:
    """One entry per (kernel, arch) from ptxas -v output."""
    kernels = []
    current: dict[str, object] | None = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line):
            current = {"kernel": m.group(1), "arch": m.group(2)}
            kernels.append(current)
        elif current is not None and (m := SPILLS.search(line)):
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    return kernels


def outputs_in_build_log(log: str) -> tuple[dict[Path, str], list[str]]:
    """Each CUDA source's compiler output in a ninja build log, and the sources it lacks."""
    outputs: dict[Path, str] = {}
    current: Path | None = None
    for line in log.splitlines():
        if step := NINJA_STEP.match(line):
            current = next((source for source in SOURCES if f" {source} " in f" {step.group(1)} "), None)
            if current is not None:
                outputs[current] = ""
        elif current is not None:
            outputs[current] += line + "\n"
    missing = [str(source.relative_to(ROOT)) for source in SOURCES if source not in outputs]
    return outputs, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=os.environ.get("TORCH_CUDA_ARCH_LIST") or "8.0;9.0a")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2")))
    parser.add_argument("--log", type=Path, help="read a full FUSEDAMP_PTXAS_VERBOSE=1 build's log "
                        "instead of compiling")
    parser.add_argument("--json", type=Path, help="also write the per-kernel report here")
    args = parser.parse_args()
    archs = [a for a in re.split(r"[;\s]+", args.archs) if a]

    if args.log:
        outputs, missing = outputs_in_build_log(args.log.read_text())
        if missing:
            print(f"check_ptxas: {args.log} does not show these compiled: {', '.join(missing)}; "
                  "read the log of a build from scratch, or run without --log", file=sys.stderr)
            return 1
        if not any("Compiling entry function" in output for output in outputs.values()):
            print(f"check_ptxas: {args.log} has no ptxas report; build with FUSEDAMP_PTXAS_VERBOSE=1",
                  file=sys.stderr)
            return 1
        results = [(source, output, 0.0, 0) for source, output in outputs.items()]
        wall = 0.0
    else:
        nvcc = find_nvcc()

        def compile_one(source: Path) -> tuple[Path, str, float, int]:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                done = subprocess.run(nvcc_command(nvcc, source, archs, Path(tmp) / "out.o"),
                                      capture_output=True, text=True)
                return source, done.stdout + done.stderr, time.perf_counter() - start, done.returncode

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(compile_one, SOURCES))
        wall = time.perf_counter() - start

    failures, report = [], []
    for source, output, seconds, returncode in results:
        name = source.relative_to(ROOT)
        print(f"{name}: {seconds:.1f} s")
        if returncode != 0:
            failures.append(f"{name}: nvcc failed\n{output}")
            continue
        for line in output.splitlines():
            if SERIALIZATION.search(line):
                failures.append(f"{name}: {line.strip()}")
        for kernel in parse(output):
            kernel["source"] = str(name)
            report.append(kernel)
            if kernel.get("spill_stores", 0) or kernel.get("spill_loads", 0):
                failures.append(f"{name}: {kernel['kernel']} ({kernel['arch']}) spills: {kernel}")
    for kernel in report:
        print(f"  {kernel['arch']:7} regs {kernel.get('registers', '?'):>3}  spills "
              f"{kernel.get('spill_stores', 0)}/{kernel.get('spill_loads', 0)}  {kernel['kernel']}")
    if args.log:
        print(f"read the ptxas reports of {len(SOURCES)} files from {args.log}")
    else:
        print(f"compiled {len(SOURCES)} files for {';'.join(archs)} in {wall:.1f} s wall "
              f"({args.jobs} jobs)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"archs": archs, "wall_s": wall, "kernels": report},
                                        indent=2))
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

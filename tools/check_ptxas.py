"""Fails on register spills in any CUDA kernel or on ptxas wgmma serialization warnings (C7510,
C7511), and when a target arch has no ptxas report. Needs nvcc and torch, no GPU. Either compiles
every CUDA source with ``-Xptxas -v`` (the build's nvcc command, tools/compile_cuda_file.py), or
reads the log of a full build made with FUSEDAMP_PTXAS_VERBOSE=1 (what CI does: one compile).

    python -m tools.check_ptxas                 # archs 7.5;8.0;9.0a, or TORCH_CUDA_ARCH_LIST
    python -m tools.check_ptxas --jobs 2 --json out/ptxas.json
    FUSEDAMP_PTXAS_VERBOSE=1 make build 2>&1 | tee build.log
    python -m tools.check_ptxas --log build.log  # from a build from scratch

Below sm_80 the mma.sync GEMM kernel compiles to an empty body (csrc/cuda/gemm/sm80.cuh): its
sm_75 entries are reported like any other kernel's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.compile_cuda_file import DEFAULT_ARCHS, ROOT, SOURCES, find_nvcc, split_archs
from tools.compile_cuda_file import nvcc_command as build_nvcc_command

SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SERIALIZATION = re.compile(r"C751[01]|wgmma[^\n]*serializ", re.IGNORECASE)
# A build step in ninja's output: "[3/12] <command>", the step's own output on the lines after it.
NINJA_STEP = re.compile(r"^\[\d+/\d+\] (.*)$")
# A target in an nvcc command: -gencode=arch=compute_75,code=sm_75 -> 7.5 (9.0a for sm_90a).
GENCODE = re.compile(r"code=sm_(\d+?)(\d[af]?)\b")


def nvcc_command(nvcc: str, source: Path, archs: list[str], out: Path) -> list[str]:
    """The build's nvcc command for `source` and every arch at once, with ptxas' report."""
    # cpp_extension guesses the toolkit when imported; tell it the one nvcc belongs to.
    os.environ.setdefault("CUDA_HOME", str(Path(nvcc).parent.parent))
    return build_nvcc_command(nvcc, source, archs, out, ptxas_verbose=True)


def sm_name(arch: str) -> str:
    """ptxas' name of a TORCH_CUDA_ARCH_LIST entry: 7.5 -> sm_75, 9.0a+PTX -> sm_90a."""
    return "sm_" + arch.removesuffix("+PTX").replace(".", "")


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
    parser.add_argument("--archs", default=os.environ.get("TORCH_CUDA_ARCH_LIST"),
                        help=f"the archs to compile for (default: TORCH_CUDA_ARCH_LIST, else "
                        f"{DEFAULT_ARCHS}), or with --log the archs each file's report must cover "
                        "(default: TORCH_CUDA_ARCH_LIST, else the log's -gencode targets)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", "2")))
    parser.add_argument("--log", type=Path, help="read a full FUSEDAMP_PTXAS_VERBOSE=1 build's log "
                        "instead of compiling")
    parser.add_argument("--json", type=Path, help="also write the per-kernel report here")
    args = parser.parse_args()
    if args.log:
        log = args.log.read_text()
        targets = sorted({f"{major}.{minor}" for major, minor in GENCODE.findall(log)})
        archs = split_archs(args.archs) if args.archs else targets
        outputs, missing = outputs_in_build_log(log)
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
        archs = split_archs(args.archs or DEFAULT_ARCHS)
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
        kernels = parse(output)
        # Every target arch has its ptxas report in every file: one without (7.5, say) was not
        # compiled for it, and what CI means to check was not checked.
        for sm in sorted({sm_name(arch) for arch in archs} - {k["arch"] for k in kernels}):
            failures.append(f"{name}: no ptxas report for {sm}; was it a target of this build?")
        for kernel in kernels:
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

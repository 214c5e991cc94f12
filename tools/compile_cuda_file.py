"""Compiles CUDA sources of csrc/cuda one file and one arch at a time, with the nvcc command line
the full build (setup.py through torch.utils.cpp_extension) gives them, and prints a table of
which (file, arch) compiled. Needs nvcc and torch, no GPU: the quick check of one file for one
arch, instead of a full build.

    python -m tools.compile_cuda_file csrc/cuda/amp.cu --archs 7.5
    python -m tools.compile_cuda_file --all --archs "7.5;8.0;9.0a" --json out/compile.json
    python -m tools.compile_cuda_file csrc/cuda/gemm/sm80_fp16.cu --archs 7.5 --ptxas-verbose
    python -m tools.compile_cuda_file csrc/cuda/amp.cu --archs 8.0 --print-command

Archs default to TORCH_CUDA_ARCH_LIST, else 7.5;8.0;9.0a (what CI compiles). Each (file, arch) is
its own nvcc call (-gencode arch=compute_XY,code=sm_XY; "+PTX" adds code=compute_XY), so a failure
names its arch. Exit status 1 when any compile fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "csrc" / "cuda").rglob("*.cu"))
DEFAULT_ARCHS = "7.5;8.0;9.0a"
# What setup.py gives nvcc besides cpp_extension's own flags (keep in step with setup.py).
NVCC_FLAGS = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "--fmad=false"]
# setup.py's define_macros with every CPU kernel build on (FUSEDAMP_CPU_ISAS=all, as in CI); nvcc
# sees them as the C++ compiler does.
DEFINES = [
    "FUSEDAMP_WITH_CUDA=1", "FUSEDAMP_BUILT_AVX512=1", "FUSEDAMP_BUILT_AVX2=1", "FUSEDAMP_BUILT_BASELINE=1"
]
ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")
# ptxas and nvcc warnings worth a look (spill reports come with -Xptxas -v only, see check_ptxas).
WARNING = re.compile(r"\bwarning\b", re.IGNORECASE)


def find_nvcc() -> str:
    """The toolkit's nvcc: CUDA_HOME's, else the one `nvcc` on PATH runs (it may be a wrapper
    script outside the toolkit; `nvcc --dryrun` prints the toolkit as `#$ TOP=...`)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("compile_cuda_file: nvcc not found; set CUDA_HOME or put nvcc on PATH")
    dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull], capture_output=True,
                         text=True)
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    return str(Path(os.path.normpath(top.group(1).strip())) / "bin" / "nvcc") if top else nvcc


def split_archs(archs: str) -> list[str]:
    """The entries of a TORCH_CUDA_ARCH_LIST value ("7.5;8.0 9.0a", "Turing;Hopper"), named archs
    expanded as the build expands them (fusedamp/_cuda_archs.py, loaded by path: importing the
    package needs a built _C)."""
    spec = importlib.util.spec_from_file_location("fusedamp_cuda_archs",
                                                  ROOT / "fusedamp" / "_cuda_archs.py")
    cuda_archs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_archs)
    entries = cuda_archs.split_arch_list(archs)
    for arch in entries:
        if not ARCH.match(arch):
            sys.exit(f"compile_cuda_file: {arch!r} is not an arch like 7.5, 9.0a or 8.6+PTX")
    return entries


def gencode(arch: str) -> list[str]:
    """-gencode flags for one arch, as cpp_extension writes them."""
    major, minor, suffix, ptx = ARCH.match(arch).groups()
    number = f"{major}{minor}{suffix}"
    flags = [f"-gencode=arch=compute_{number},code=sm_{number}"]
    if ptx:
        flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
    return flags


def include_dirs(nvcc: str) -> list[Path]:
    """setup.py's include dirs, then cpp_extension's (torch's and the toolkit's), then Python's."""
    dirs = [ROOT / "csrc" / "include", ROOT / "csrc"]
    for site in sys.path:
        cu_headers = Path(site) / "nvidia" / "cu13" / "include"
        if cu_headers.is_dir():
            dirs.append(cu_headers)
            break
    import torch.utils.cpp_extension as ext

    dirs += [Path(p) for p in ext.include_paths()]  # torch/include, torch/csrc/api/include
    dirs.append(Path(nvcc).resolve().parent.parent / "include")
    venv_include = Path(sys.prefix) / "include"
    if venv_include.is_dir():
        dirs.append(venv_include)
    dirs.append(Path(sysconfig.get_paths()["include"]))
    return dirs


def nvcc_command(nvcc: str, source: Path, archs: list[str], out: Path,
                 ptxas_verbose: bool = False) -> list[str]:
    """The nvcc command line that the build runs for `source` (archs: entries of split_archs)."""
    return [
        nvcc, *(f"-I{p}" for p in include_dirs(nvcc)), *(f"-D{d}" for d in DEFINES),
        "-c", str(source), "-o", str(out),
        # torch.utils.cpp_extension's COMMON_NVCC_FLAGS and -fPIC
        "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr", "--compiler-options", "-fPIC",
        *NVCC_FLAGS, *(["-Xptxas=-v"] if ptxas_verbose else []),
        *(flag for arch in archs for flag in gencode(arch)),
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", "-std=c++20",
    ]


def compile_one(nvcc: str, source: Path, arch: str, ptxas_verbose: bool,
                out_dir: Path | None) -> dict[str, object]:
    """Compiles `source` for `arch`; a result row: file, arch, ok, seconds, output, warnings."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = out_dir if out_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        obj = folder / f"{source.stem}.{arch.replace('+', '_')}.o"
        start = time.perf_counter()
        done = subprocess.run(nvcc_command(nvcc, source, [arch], obj, ptxas_verbose),
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    return {
        "file": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source),
        "arch": arch,
        "ok": done.returncode == 0,
        "seconds": round(seconds, 1),
        "warnings": [line.strip() for line in output.splitlines() if WARNING.search(line)],
        "output": output,
    }


def first_error(output: str) -> str:
    """The line that says why a compile failed."""
    for line in output.splitlines():
        if re.search(r"\berror\b|fatal", line, re.IGNORECASE):
            return line.strip()
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def table(results: list[dict[str, object]], archs: list[str]) -> str:
    """A markdown table: one row per file, one column per arch (ok / FAIL, seconds)."""
    by_key = {(r["file"], r["arch"]): r for r in results}
    files = list(dict.fromkeys(r["file"] for r in results))
    lines = ["| file | " + " | ".join(archs) + " |", "| --- |" + " --- |" * len(archs)]
    for name in files:
        cells = []
        for arch in archs:
            r = by_key[name, arch]
            state = "ok" if r["ok"] else "FAIL"
            if r["warnings"]:
                state += f", {len(r['warnings'])} warning(s)"
            cells.append(f"{state} ({r['seconds']:.0f} s)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help=".cu files (default with --all: "
                        "every .cu under csrc/cuda)")
    parser.add_argument("--all", action="store_true", help="every .cu under csrc/cuda")
    parser.add_argument("--archs", default=os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS,
                        help="';'-separated archs, each compiled on its own (default: "
                        f"TORCH_CUDA_ARCH_LIST, else {DEFAULT_ARCHS})")
    parser.add_argument("--jobs", type=int, default=1, help="parallel nvcc calls (default 1)")
    parser.add_argument("--ptxas-verbose", action="store_true", help="pass -Xptxas -v and print "
                        "its report")
    parser.add_argument("--output-dir", type=Path, help="keep the object files here")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--print-command", action="store_true", help="print the nvcc command "
                        "lines and compile nothing")
    args = parser.parse_args()
    files = SOURCES if args.all else [f.resolve() for f in args.files]
    if not files:
        parser.error("name .cu files or pass --all")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    archs = split_archs(args.archs)
    nvcc = find_nvcc()
    # cpp_extension guesses the toolkit when imported: tell it the one nvcc belongs to.
    os.environ.setdefault("CUDA_HOME", str(Path(nvcc).parent.parent))

    jobs = [(source, arch) for source in files for arch in archs]
    if args.print_command:
        for source, arch in jobs:
            print(" ".join(nvcc_command(nvcc, source, [arch], Path(f"{source.stem}.o"),
                                        args.ptxas_verbose)))
        return 0
    start = time.perf_counter()

    def run(job: tuple[Path, str]) -> dict[str, object]:
        result = compile_one(nvcc, *job, args.ptxas_verbose, args.output_dir)
        status = "ok" if result["ok"] else "FAIL: " + first_error(result["output"])
        print(f"{result['file']} [{result['arch']}] {result['seconds']:.1f} s: {status}", flush=True)
        if args.ptxas_verbose or not result["ok"]:
            print(result["output"], end="", flush=True)
        else:
            for warning in result["warnings"]:
                print("  " + warning, flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        results = list(pool.map(run, jobs))
    print()
    print(table(results, archs))
    failed = [r for r in results if not r["ok"]]
    print(f"\n{len(results) - len(failed)}/{len(results)} compiles ok in "
          f"{time.perf_counter() - start:.0f} s wall ({nvcc})")
    for r in failed:
        print(f"FAIL: {r['file']} [{r['arch']}]: {first_error(r['output'])}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"nvcc": nvcc, "archs": archs, "results": results},
                                        indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

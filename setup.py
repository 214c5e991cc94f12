"""Builds fusedamp._C: CPU kernels always, CUDA kernels when nvcc and a CUDA build of torch exist.

    pip install --no-build-isolation .      # torch must be installed first

Environment:
- FUSEDAMP_CUDA=0|1 forces the CUDA kernels off/on; by default they are built when nvcc and a
  CUDA build of torch are present and a GPU is visible or TORCH_CUDA_ARCH_LIST is set. A build
  that sees a GPU but cannot build them (no nvcc) stops with the way out instead of building a
  CPU-only fusedamp; FUSEDAMP_CUDA=0 builds one on purpose.
- TORCH_CUDA_ARCH_LIST picks the GPU architectures (default: the visible GPUs', else 8.0;9.0a;
  9.0a is added wherever 9.0 is targeted, see fusedamp/_cuda_archs.py).
- FUSEDAMP_CPU_ISAS=native|all: the CPU kernels for the host's best ISA alone (native, the
  default; the baseline kernels too only on a CPU without AVX2), or for avx512, avx2 and baseline
  (all: portable builds, wheels, CI, and the tests that compare the ISAs' results).
- FUSEDAMP_PTXAS_VERBOSE=1 prints ptxas register/spill reports; FUSEDAMP_VERBOSE_BUILD=1 every
  compile command (otherwise the build prints its choices and what the compilers say); MAX_JOBS
  bounds the parallel compile jobs.
"""

import glob
import importlib.util
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
except ImportError:
    sys.exit(
        "fusedamp: PyTorch is not installed. Install it first (e.g. `pip install torch`), then "
        "build fusedamp with `pip install --no-build-isolation .` so the build sees that torch."
    )

# The oldest torch the tests ran on (tools/check_oldest_torch.sh); pyproject.toml and the docs say
# the same (tests/test_build.py). fusedamp imports torch.distributed.tensor, public from 2.5.
MIN_TORCH = (2, 5)
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MIN_TORCH:
    sys.exit(
        f"fusedamp: torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, the oldest "
        "torch fusedamp builds and runs with; install a newer torch first."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))


def load_cuda_archs():
    """fusedamp/_cuda_archs.py, loaded by path: importing the package would need _C."""
    spec = importlib.util.spec_from_file_location(
        "fusedamp_cuda_archs", os.path.join(ROOT, "fusedamp", "_cuda_archs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nvcc_toolkit_root(nvcc: str) -> str | None:
    """The toolkit nvcc really belongs to; `nvcc` on PATH may be a wrapper script elsewhere."""
    try:
        dryrun = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^#\$ TOP=(.+)$", dryrun.stdout + dryrun.stderr, re.MULTILINE)
    return os.path.normpath(match.group(1).strip()) if match else None


def find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    return nvcc_toolkit_root(nvcc) if nvcc else None


def want_cuda(cuda_home: str | None) -> tuple[bool, str]:
    """Whether to build the CUDA kernels, and why (for the build's one-line summary)."""
    forced = os.environ.get("FUSEDAMP_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"fusedamp: FUSEDAMP_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False, "off (FUSEDAMP_CUDA=0)"
    if torch.version.cuda is None:
        missing = f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    elif cuda_home is None:
        missing = "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    else:
        missing = None
    if forced == "1" and missing:
        sys.exit(f"fusedamp: FUSEDAMP_CUDA=1 but {missing}")
    # pip shows a build's output only when it fails: a CPU-only build for a machine with a GPU
    # would pass unnoticed until the first CUDA tensor met an op without a CUDA kernel.
    gpu_visible = torch.version.cuda is not None and torch.cuda.is_available()
    if missing and gpu_visible:
        major = torch.version.cuda.split(".")[0]
        sys.exit(
            f"fusedamp: a GPU is visible but the CUDA kernels cannot be built: {missing}. Install the "
            f"CUDA {major} toolkit (torch {torch.__version__} was built with CUDA {torch.version.cuda}) "
            "and build again, or build the CPU kernels alone on purpose with FUSEDAMP_CUDA=0."
        )
    if missing:
        return False, f"off ({missing})"
    if forced == "1":
        return True, "on (FUSEDAMP_CUDA=1)"
    # Compiling them takes most of a build: a machine without a GPU skips them unless asked.
    if gpu_visible:
        return True, "on (a GPU is visible)"
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return True, "on (TORCH_CUDA_ARCH_LIST is set)"
    return False, "off (no GPU visible; FUSEDAMP_CUDA=1 builds them anyway)"


def cpu_isas() -> tuple[tuple[str, ...], str]:
    """The CPU kernel builds (csrc/cpu/isa/) to compile, and why."""
    chosen = os.environ.get("FUSEDAMP_CPU_ISAS", "native") or "native"
    if chosen == "all":
        return ("avx512", "avx2", "baseline"), "FUSEDAMP_CPU_ISAS=all"
    if chosen != "native":
        sys.exit(f"fusedamp: FUSEDAMP_CPU_ISAS must be native or all, got {chosen!r}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return ("baseline",), "this CPU is not x86-64"
    # torch's own dispatch level: AVX512 means avx512f/bw/vl/dq, AVX2 means avx2 + fma.
    best = {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())
    if not best:
        return ("baseline",), "this CPU has no AVX2"
    return (best,), "this CPU's best; FUSEDAMP_CPU_ISAS=all builds avx512, avx2 and baseline"


def check_nvcc_matches_torch(cuda_home: str) -> int:
    """Exits unless nvcc's CUDA major version is torch's; returns it."""
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                         capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    if not found:
        sys.exit(f"fusedamp: could not read the CUDA version from {cuda_home}/bin/nvcc --version")
    nvcc_major = int(found.group(1))
    torch_major = int(torch.version.cuda.split(".")[0])
    if nvcc_major != torch_major:
        sys.exit(
            f"fusedamp: nvcc is CUDA {found.group(1)}.{found.group(2)} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; the major versions "
            "must match. Install the matching toolkit or torch build, or build CPU-only with "
            "FUSEDAMP_CUDA=0."
        )
    return nvcc_major


cuda_home = find_cuda_home()
with_cuda, cuda_reason = want_cuda(cuda_home)
CPU_ISAS, isa_reason = cpu_isas()
print(f"fusedamp: CPU kernels for {' + '.join(CPU_ISAS)} ({isa_reason}); CUDA kernels {cuda_reason}",
      flush=True)
if with_cuda:
    # cpp_extension reads CUDA_HOME when it is imported: resolve the wrapper before that.
    os.environ["CUDA_HOME"] = cuda_home
    cuda_major = check_nvcc_matches_torch(cuda_home)
    visible = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    cuda_archs_module = load_cuda_archs()
    archs, note = cuda_archs_module.resolve_archs(
        os.environ.get("TORCH_CUDA_ARCH_LIST"), visible, torch.cuda.get_arch_list())
    if note:
        print(note, flush=True)
    too_old = cuda_archs_module.archs_too_old(archs, cuda_major)
    if too_old:
        oldest = ".".join(map(str, cuda_archs_module.oldest_arch(cuda_major)))
        sys.exit(
            f"fusedamp: CUDA {cuda_major} cannot build for arch {', '.join(too_old)} (asked for by "
            f"TORCH_CUDA_ARCH_LIST or a visible GPU): it compiles for {oldest} and newer only. For "
            "Volta and older GPUs use a CUDA 12 toolkit and a CUDA 12 build of torch; otherwise drop "
            "those archs (e.g. TORCH_CUDA_ARCH_LIST=\"7.5;8.0;9.0a\"), or build CPU-only with "
            "FUSEDAMP_CUDA=0."
        )
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs

# Without a GPU cpp_extension logs "No CUDA runtime is found" when imported; the line above said
# what the build chose, and why.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
from torch.utils import cpp_extension  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

# torch's BuildExtension runs ninja verbosely, straight to the console: a compile command per
# file. Unless asked for them (or for ptxas's reports, which come in the same output), the build
# keeps ninja's progress lines to itself and prints what the compilers said: warnings, errors.
VERBOSE_BUILD = "1" in (os.environ.get("FUSEDAMP_VERBOSE_BUILD"), os.environ.get("FUSEDAMP_PTXAS_VERBOSE"))
run_ninja_verbosely = cpp_extension._run_ninja_build
NINJA_PROGRESS = re.compile(r"\[\d+/\d+\] |ninja: no work to do\.$")


def run_ninja(build_directory: str, verbose: bool, error_prefix: str) -> None:
    if VERBOSE_BUILD:
        run_ninja_verbosely(build_directory, verbose, error_prefix)
        return
    jobs = ["-j", os.environ["MAX_JOBS"]] if os.environ.get("MAX_JOBS") else []
    done = subprocess.run(["ninja", *jobs], cwd=build_directory, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    said = [line for line in done.stdout.splitlines() if not NINJA_PROGRESS.match(line)]
    if said:
        print("\n".join(said), flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"{error_prefix} (FUSEDAMP_VERBOSE_BUILD=1 prints every compile command)")


cpp_extension._run_ninja_build = run_ninja

cuda_archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if with_cuda else ""
with open(os.path.join(ROOT, "fusedamp", "_build_meta.py"), "w") as meta:
    meta.write(
        '"""Written by setup.py at build time: how this copy of fusedamp._C was built."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_COMPILED = {with_cuda!r}\n"
        f"CUDA_ARCHS = {cuda_archs!r}\n"
        f"CUDA_REASON = {cuda_reason!r}\n"
        f"CPU_ISAS = {CPU_ISAS!r}\n"
    )


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
for site in sys.path:
    cu_headers = os.path.join(site, "nvidia", "cu13", "include")
    if os.path.isdir(cu_headers):
        include_dirs.append(cu_headers)
        break

# ATen's at::parallel_for is an inline `#pragma omp parallel`: without -fopenmp every CPU kernel
# runs on one thread (csrc/cpu/launcher.h refuses to compile then). Link the OpenMP runtime torch
# itself loads (torch/lib/libgomp.so.1), never a second one with its own thread pool.
# No contraction of a * b + c into FMAs (-ffp-contract=off here, --fmad=false for nvcc): every ISA
# build and the CUDA kernels then round alike, so optimizer states (8-bit codes included) are
# bitwise the same on AVX-512, AVX2, baseline and CUDA.
cxx_flags = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
# No debug info (Python's build flags carry -g): the templated CPU kernels compile about a third
# faster without it, and a fresh `make test` is mostly that compile. FUSEDAMP_DEBUG=1 keeps it.
if os.environ.get("FUSEDAMP_DEBUG", "0") != "1":
    cxx_flags.append("-g0")


def compiler_is_gcc_for_x86() -> bool:
    """Whether the C++ compiler torch builds with is GCC targeting x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        found = subprocess.run(shlex.split(os.environ.get("CXX", "c++")) + ["--version"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return "Free Software Foundation" in found.stdout


# GCC keeps the vector constants (set1 of one value) that register pressure leaves inside a loop
# as a move from an integer register and a broadcast, two shuffle-port uops each time; without
# integer-to-vector moves it folds them into the instructions as memory operands: the int8
# AdamW step on the AVX2 build ran faster with it, and its codes are the same bits.
if compiler_is_gcc_for_x86():
    cxx_flags.append("-mtune-ctrl=^inter_unit_moves_to_vec")
torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
link_flags = ["-fopenmp", f"-Wl,-rpath,{torch_lib}"]
# Which ISA builds exist, for csrc/cpu/isa.cpp's choice at run time.
isa_macros = [
    (f"FUSEDAMP_BUILT_{isa.upper()}", str(int(isa in CPU_ISAS))) for isa in ("avx512", "avx2", "baseline")
]


def cpu_kernel_sources() -> list[str]:
    """Each file of csrc/cpu/kernels/ once per ISA: a generated source that includes the ISA's
    preamble (csrc/cpu/isa/<isa>.h) and then the file. Written only when its text changes, so
    that ninja rebuilds only what changed."""
    generated = []
    # The drivers live in the baseline build: without the baseline kernels it builds them alone.
    drivers_only = "baseline" not in CPU_ISAS
    for kernel in sources("csrc/cpu/kernels/*.cpp"):
        name = os.path.splitext(os.path.basename(kernel))[0]
        for isa in (*CPU_ISAS, "baseline") if drivers_only else CPU_ISAS:
            path = os.path.join("build", "generated", "cpu", isa, f"{name}.cpp")
            only = "#define FUSEDAMP_CPU_DRIVERS_ONLY 1\n" if isa == "baseline" and drivers_only else ""
            text = (
                f"// Generated by setup.py: {kernel} built for {isa}.\n"
                f"{only}"
                f'#include "cpu/isa/{isa}.h"\n'
                f'#include "cpu/kernels/{name}.cpp"\n'
            )
            full = os.path.join(ROOT, path)
            if not os.path.exists(full) or open(full).read() != text:
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w") as out:
                    out.write(text)
            generated.append(path)
    # The longest compiles first (the optimizers' vector builds), so that the short ones fill
    # the other jobs while they run instead of leaving one of them last and alone.
    optimizers = ("adamw", "sgd", "muon")

    def compile_order(path: str) -> tuple[int, bool]:
        name = os.path.splitext(os.path.basename(path))[0]
        rank = optimizers.index(name) if name in optimizers else len(optimizers)
        return rank, drivers_only and os.sep + "baseline" + os.sep in path

    return sorted(generated, key=compile_order)


ext_sources = (cpu_kernel_sources() + sources("csrc/*.cpp") + sources("csrc/common/*.cpp")
               + sources("csrc/ops/*.cpp") + sources("csrc/python/*.cpp") + sources("csrc/cpu/*.cpp"))
if with_cuda:
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "--fmad=false"]
    if os.environ.get("FUSEDAMP_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    extension = CUDAExtension(
        "fusedamp._C",
        ext_sources + sources("csrc/cuda/**/*.cu") + sources("csrc/cuda/**/*.cpp"),
        include_dirs=include_dirs,
        define_macros=[("FUSEDAMP_WITH_CUDA", "1"), *isa_macros],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        "fusedamp._C", ext_sources, include_dirs=include_dirs, define_macros=isa_macros,
        extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags,
    )

setup(
    packages=find_packages(include=["fusedamp", "fusedamp.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

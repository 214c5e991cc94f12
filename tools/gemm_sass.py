"""The GEMM kernel instances' SASS, measured without a GPU: for each (arch, instance) of the
extension (or of object files from ``tools.compile_cuda_file --output-dir``), its instruction count,
the epilogue's (from the last Tensor Core instruction to the last output store) and the counts of
the instructions that tell an epilogue's work apart (MUFU: erf/tanh; LDG: bias reads; LDS/STS;
LDL/STL: local memory, i.e. spills). tests/test_gemm_sass.py checks these; this prints them.

    python -m tools.gemm_sass                            # the built fusedamp._C
    python -m tools.gemm_sass out/objects/sm90_bf16.9.0a.o --json out/sass.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

# Instruction classes counted per instance (opcode prefixes).
COUNTED = ("MUFU", "LDG", "LDS", "STS", "STG", "LDL", "STL", "HMMA", "HGMMA", "UTMASTG", "UTMALDG")
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh")  # the values of fusedamp::gemm::Activation
SCHEDULES = ("cooperative", "pingpong")  # the values of fusedamp::gemm::Sm90Schedule
# Template arguments of a kernel instance: [Sm90Schedule (wgmma only),] T, kAKMajor, kBKMajor,
# kBias, Activation kAct.
INSTANCE = re.compile(
    r"(gemm_sm[89]0_kernel)I(?:LNS0_12Sm90ScheduleE(\d)E)?(\d+__\w+?)Lb([01])ELb([01])ELb([01])E"
    r"LNS0_10ActivationE(\d)EE"
)
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def find_tool(name: str) -> str | None:
    """The tool from the nvidia-cuda-* wheels next to this interpreter, else from PATH."""
    for site in sys.path:
        candidate = os.path.join(site, "nvidia", "cu13", "bin", name)
        if os.path.isfile(candidate):
            return candidate
    return shutil.which(name)


def sass_by_arch_and_kernel(paths: list[str]) -> dict[tuple[str, str], str]:
    """{(arch, mangled kernel name): its SASS} for every kernel in the files (cuobjdump -sass)."""
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise FileNotFoundError("cuobjdump/nvdisasm missing: pip install nvidia-cuda-cuobjdump "
                                "nvidia-cuda-nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ["PATH"])
    lines: dict[tuple[str, str], list[str]] = {}  # joined once at the end: += on the strings was quadratic
    for path in paths:
        dump = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, env=env,
                              check=True).stdout
        arch = None
        current: list[str] | None = None
        for line in dump.splitlines():
            if m := re.match(r"\s*code for (sm_\w+)", line):
                arch, current = m.group(1), None
            elif m := re.match(r"\s*Function : (\S+)", line):
                current = lines[arch, m.group(1)] = []
            elif current is not None:
                current.append(line)
    return {key: "\n".join(body) + "\n" if body else "" for key, body in lines.items()}


@cache
def file_sass(path: str) -> dict[tuple[str, str], str]:
    """sass_by_arch_and_kernel of one file, made once a process: the checks of several kernel
    families read the built extension's (most of a minute of cuobjdump)."""
    return sass_by_arch_and_kernel([path])


def opcodes(sass: str) -> list[str]:
    """The opcodes of a function's SASS, in order (predicates dropped)."""
    return INSTRUCTION.findall(sass)


@dataclass
class Instance:
    """One GEMM kernel instance's SASS, measured."""

    arch: str
    family: str  # gemm_sm80_kernel (mma.sync) or gemm_sm90_kernel (wgmma)
    schedule: str  # the wgmma schedule (cooperative, pingpong); "" for mma.sync
    dtype: str  # the input type's mangled name, e.g. 6__half, 13__nv_bfloat16
    a_k_major: bool
    b_k_major: bool
    bias: bool
    activation: str
    instructions: int
    epilogue: int  # from the last HMMA/HGMMA to the last STG/UTMASTG
    counts: dict[str, int]

    @property
    def name(self) -> str:
        layouts = ("k" if self.a_k_major else "m") + ("k" if self.b_k_major else "n")
        family = f"{self.family} {self.schedule}" if self.schedule else self.family
        return f"{family} {self.dtype} {layouts} bias={int(self.bias)} {self.activation}"


def epilogue_length(ops: list[str]) -> int:
    """Instructions from the last Tensor Core instruction to the last output store."""
    mma = [i for i, op in enumerate(ops) if op.startswith(("HMMA", "HGMMA"))]
    stores = [i for i, op in enumerate(ops) if op.startswith(("STG", "UTMASTG"))]
    if not mma or not stores or stores[-1] < mma[-1]:
        return 0
    return stores[-1] - mma[-1]


def measure(kernels: dict[tuple[str, str], str]) -> list[Instance]:
    """Every GEMM kernel instance among `kernels`, measured."""
    found = []
    for (arch, name), sass in sorted(kernels.items()):
        m = INSTANCE.search(name)
        if m is None:
            continue
        family, schedule, dtype, a_k, b_k, bias, act = m.groups()
        ops = opcodes(sass)
        counts = {c: sum(op.split(".")[0] == c for op in ops) for c in COUNTED}
        found.append(Instance(arch, family, SCHEDULES[int(schedule)] if schedule else "", dtype,
                              a_k == "1", b_k == "1", bias == "1", ACTIVATIONS[int(act)], len(ops),
                              epilogue_length(ops), counts))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="object files or shared libraries (default: the "
                        "built fusedamp._C)")
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args()
    files = args.files
    if not files:
        from fusedamp import _C

        files = [_C.__file__]
    instances = measure(sass_by_arch_and_kernel(files))
    print(f"{'arch':8} {'instance':70} {'SASS':>7} {'epilogue':>8}  " + " ".join(
        f"{c:>7}" for c in COUNTED))
    for i in instances:
        print(f"{i.arch:8} {i.name:70} {i.instructions:7d} {i.epilogue:8d}  " + " ".join(
            f"{i.counts[c]:7d}" for c in COUNTED))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(i) for i in instances], indent=2))
    return 0 if instances else 1


if __name__ == "__main__":
    sys.exit(main())

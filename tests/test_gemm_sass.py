"""What the GEMM kernels compiled to, checked without a GPU: cuobjdump -sass on the built
extension must show HMMA.16816.F32 (+ ldmatrix, cp.async) in the sm_80 code of the mma.sync kernel,
an empty body in its sm_75 code, and HGMMA (+ TMA, setmaxnreg) in the sm_90a code of the wgmma
kernel."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import cache

import pytest
import torch

import fusedamp
from fusedamp import _C

GEMM_CUDA_BUILT = _C.cuda_compiled and torch._C._dispatch_has_kernel_for_dispatch_key(
    "fusedamp::gemm", "CUDA"
)
BUILT_ARCHS = ["sm_" + arch.replace(".", "") for arch in fusedamp.build_info()["cuda_archs"]]


def _find_tool(name: str) -> str | None:
    """The tool from the nvidia-cuda-* wheels next to this interpreter, else from PATH."""
    for site in sys.path:
        candidate = os.path.join(site, "nvidia", "cu13", "bin", name)
        if os.path.isfile(candidate):
            return candidate
    return shutil.which(name)


CUOBJDUMP = _find_tool("cuobjdump")
NVDISASM = _find_tool("nvdisasm")

pytestmark = [
    pytest.mark.skipif(
        not GEMM_CUDA_BUILT,
        reason="fusedamp._C was built without CUDA gemm kernels (FUSEDAMP_CUDA=0 or no nvcc)",
    ),
    pytest.mark.skipif(
        CUOBJDUMP is None or NVDISASM is None,
        reason="cuobjdump/nvdisasm missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm",
    ),
]


@cache
def sass_by_arch_and_kernel() -> dict[tuple[str, str], str]:
    """{(arch, mangled kernel name): its SASS} for every kernel in fusedamp._C."""
    env = dict(os.environ, PATH=os.path.dirname(NVDISASM) + os.pathsep + os.environ["PATH"])
    dump = subprocess.run(
        [CUOBJDUMP, "-sass", _C.__file__], capture_output=True, text=True, env=env, check=True
    ).stdout
    kernels: dict[tuple[str, str], str] = {}
    arch = name = None
    for line in dump.splitlines():
        if m := re.match(r"\s*code for (sm_\w+)", line):
            arch, name = m.group(1), None
        elif m := re.match(r"\s*Function : (\S+)", line):
            name = m.group(1)
            kernels[arch, name] = ""
        elif name is not None:
            kernels[arch, name] += line + "\n"
    return kernels


def kernels(arch: str, family: str) -> dict[str, str]:
    if arch not in BUILT_ARCHS:
        pytest.skip(f"{arch} is not among the built archs {BUILT_ARCHS}")
    found = {n: s for (a, n), s in sass_by_arch_and_kernel().items() if a == arch and family in n}
    assert found, f"no {family} kernels in the {arch} code of {_C.__file__}"
    return found


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_mma_sync_kernels_use_hmma_ldmatrix_and_cp_async(arch):
    for name, sass in kernels(arch, "gemm_sm80_kernel").items():
        assert "HMMA.16816.F32" in sass, name
        assert "LDSM" in sass, name  # ldmatrix
        assert "LDGSTS" in sass, name  # cp.async
        assert "LDL" not in sass and "STL" not in sass, f"{name} uses local memory"


def test_mma_sync_kernels_are_empty_below_sm80():
    # A build for Turing (7.5) holds the mma.sync kernels with empty bodies (no cp.async, no
    # m16n8k16 there): the gemm never launches them (sm80_kernels_built() checks the PTX version).
    for name, sass in kernels("sm_75", "gemm_sm80_kernel").items():
        assert "HMMA" not in sass and "LDGSTS" not in sass and "LDSM" not in sass, name
        assert "EXIT" in sass, name


def test_wgmma_kernels_use_hgmma_tma_and_setmaxnreg():
    for name, sass in kernels("sm_90a", "gemm_sm90_kernel").items():
        assert re.search(r"HGMMA\.64x256x16\.F32", sass), name
        assert "UTMALDG" in sass, name  # TMA loads
        assert "UTMASTG" in sass, name  # TMA stores (epilogue)
        assert "USETMAXREG" in sass, name
        assert "LDL" not in sass and "STL" not in sass, f"{name} uses local memory"


def test_wgmma_transposes_follow_the_layouts():
    # Template arguments <T, a_k_major, b_k_major>: MN-major operands are read transposed.
    for name, sass in kernels("sm_90a", "gemm_sm90_kernel").items():
        a_k_major, b_k_major = re.search(r"Lb([01])ELb([01])E", name).groups()
        hgmma = re.search(r"HGMMA\.\S+ \S+ gdesc\[\w+\](\S*),", sass).group(1)
        assert ("tnspA" in hgmma) == (a_k_major == "0"), name
        assert ("tnspB" in hgmma) == (b_k_major == "0"), name

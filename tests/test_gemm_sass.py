"""What the GEMM kernels compiled to, checked without a GPU: cuobjdump -sass on the built
extension must show HMMA.16816.F32 (+ ldmatrix, cp.async) in the sm_80 code of the mma.sync kernel,
an empty body in its sm_75 code, and HGMMA (+ TMA, setmaxnreg) in the sm_90a code of the wgmma
kernel, of each schedule's shape, with one wgmma group in flight and the ping-pong turn barriers;
and each epilogue instance (bias or not, activation) must hold its own code and no more,
within a size bound, without local memory (tools/gemm_sass.py measures them).

FUSEDAMP_GEMM_SASS_FILES (paths joined by os.pathsep) checks object files instead of the built
extension, e.g. those of `python -m tools.compile_cuda_file csrc/cuda/gemm/sm90_bf16.cu --archs 9.0a
--output-dir out/objects`: the check of one kernel file without a full CUDA build."""

from __future__ import annotations

import itertools
import os
import re
from functools import cache

import pytest
import torch

import fusedamp
from fusedamp import _C
from tools.gemm_sass import (
    ACTIVATIONS,
    SCHEDULES,
    Instance,
    file_sass,
    find_tool,
    measure,
    sass_by_arch_and_kernel,
)

FILES = [f for f in os.environ.get("FUSEDAMP_GEMM_SASS_FILES", "").split(os.pathsep) if f]
GEMM_CUDA_BUILT = _C.cuda_compiled and torch._C._dispatch_has_kernel_for_dispatch_key(
    "fusedamp::gemm", "CUDA"
)
BUILT_ARCHS = ["sm_" + arch.replace(".", "") for arch in fusedamp.build_info()["cuda_archs"]]

# Upper bounds on an instance's epilogue (instructions from the last Tensor Core instruction to the
# last output store), per (family, activation), about 20% above what nvcc 13.0 gives. Before the
# bias and the activation were template parameters, every instance held all of them: about 10,700
# (wgmma) and 9,100 (mma.sync) instructions.
EPILOGUE_BOUND = {
    ("gemm_sm90_kernel", "none"): 1_400,
    ("gemm_sm90_kernel", "relu"): 1_400,
    ("gemm_sm90_kernel", "gelu"): 5_000,
    ("gemm_sm90_kernel", "gelu_tanh"): 5_000,
    ("gemm_sm80_kernel", "none"): 5_300,
    ("gemm_sm80_kernel", "relu"): 5_300,
    ("gemm_sm80_kernel", "gelu"): 9_100,
    ("gemm_sm80_kernel", "gelu_tanh"): 8_500,
}
ACCUMULATORS = {"gemm_sm90_kernel": 128, "gemm_sm80_kernel": 64}  # fp32 accumulators per thread

pytestmark = [
    pytest.mark.skipif(
        not FILES and not GEMM_CUDA_BUILT,
        reason="fusedamp._C was built without CUDA gemm kernels (FUSEDAMP_CUDA=0 or no nvcc)",
    ),
    pytest.mark.skipif(
        find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
        reason="cuobjdump/nvdisasm missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm",
    ),
]


@cache
def sass() -> dict[tuple[str, str], str]:
    return sass_by_arch_and_kernel(FILES) if FILES else file_sass(_C.__file__)


@cache
def instances() -> list[Instance]:
    return measure(sass())


def require_arch(arch: str) -> None:
    present = {a for a, _ in sass()}
    if arch not in present or (not FILES and arch not in BUILT_ARCHS):
        pytest.skip(f"no {arch} code in {FILES or _C.__file__}")


def kernels(arch: str, family: str) -> dict[str, str]:
    require_arch(arch)
    found = {n: s for (a, n), s in sass().items() if a == arch and family in n}
    if FILES and not found:
        pytest.skip(f"no {family} kernels in {FILES}")
    assert found, f"no {family} kernels in the {arch} code of {_C.__file__}"
    return found


def family_instances(arch: str, family: str) -> list[Instance]:
    kernels(arch, family)
    return [i for i in instances() if i.arch == arch and i.family == family]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_mma_sync_kernels_use_hmma_ldmatrix_and_cp_async(arch):
    for name, code in kernels(arch, "gemm_sm80_kernel").items():
        assert "HMMA.16816.F32" in code, name
        assert "LDSM" in code, name  # ldmatrix
        assert "LDGSTS" in code, name  # cp.async
        assert "LDL" not in code and "STL" not in code, f"{name} uses local memory"


def test_mma_sync_kernels_are_empty_below_sm80():
    # A build for Turing (7.5) holds the mma.sync kernels with empty bodies (no cp.async, no
    # m16n8k16 there): the gemm never launches them (sm80_kernels_built() checks the PTX version).
    for name, code in kernels("sm_75", "gemm_sm80_kernel").items():
        assert "HMMA" not in code and "LDGSTS" not in code and "LDSM" not in code, name
        assert "EXIT" in code, name


# The wgmma shape of each schedule (template argument Sm90Schedule: 0 cooperative, 1 ping-pong).
HGMMA_SHAPE = {"0": "64x256x16", "1": "64x128x16"}


def test_wgmma_kernels_use_hgmma_tma_and_setmaxnreg():
    for name, code in kernels("sm_90a", "gemm_sm90_kernel").items():
        shape = HGMMA_SHAPE[re.search(r"Sm90ScheduleE(\d)E", name).group(1)]
        assert re.search(rf"HGMMA\.{shape}\.F32", code), name
        # One k tile of wgmmas stays in flight while the next is issued.
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in code, name
        assert "UTMALDG" in code, name  # TMA loads
        assert "UTMASTG" in code, name  # TMA stores (epilogue)
        assert "USETMAXREG" in code, name
        assert "LDL" not in code and "STL" not in code, f"{name} uses local memory"


def test_pingpong_consumers_take_turns():
    # A ping-pong consumer waits for its turn (bar.sync on 256 threads: its own warpgroup and the
    # other consumer's arrival) and gives the other its turn (bar.arrive) after its main loop.
    for name, code in kernels("sm_90a", "gemm_sm90_kernel").items():
        pingpong = "Sm90ScheduleE1E" in name
        assert (re.search(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100", code) is not None) == pingpong, name
        assert (re.search(r"BAR\.ARV R\d+, 0x100", code) is not None) == pingpong, name


def test_wgmma_transposes_follow_the_layouts():
    # Template arguments <T, a_k_major, b_k_major, ...>: MN-major operands are read transposed.
    for name, code in kernels("sm_90a", "gemm_sm90_kernel").items():
        a_k_major, b_k_major = re.search(r"Lb([01])ELb([01])E", name).groups()
        hgmma = re.search(r"HGMMA\.\S+ \S+ gdesc\[\w+\](\S*),", code).group(1)
        assert ("tnspA" in hgmma) == (a_k_major == "0"), name
        assert ("tnspB" in hgmma) == (b_k_major == "0"), name


FAMILIES = [("sm_80", "gemm_sm80_kernel"), ("sm_90a", "gemm_sm90_kernel"), ("sm_90a", "gemm_sm80_kernel")]


@pytest.mark.parametrize("arch,family", FAMILIES)
def test_every_epilogue_has_its_own_instance(arch, family):
    found = family_instances(arch, family)
    schedules = {"gemm_sm90_kernel": SCHEDULES, "gemm_sm80_kernel": ("",)}[family]
    for dtype in {i.dtype for i in found}:
        combos = {(i.schedule, i.a_k_major, i.b_k_major, i.bias, i.activation)
                  for i in found if i.dtype == dtype}
        assert combos == set(itertools.product(schedules, [False, True], [False, True], [False, True],
                                               ACTIVATIONS))


@pytest.mark.parametrize("arch,family", FAMILIES)
def test_epilogues_hold_only_their_own_bias_and_activation_code(arch, family):
    found = family_instances(arch, family)
    plain = {(i.schedule, i.dtype, i.a_k_major, i.b_k_major): i
             for i in found if not i.bias and i.activation == "none"}
    for i in found:
        base = plain[i.schedule, i.dtype, i.a_k_major, i.b_k_major]
        assert i.counts["LDL"] == 0 and i.counts["STL"] == 0, f"{i.name} uses local memory"
        assert i.epilogue <= EPILOGUE_BOUND[family, i.activation], (i.name, i.epilogue)
        # Bias reads (LDG: the kernels read their operands with TMA or cp.async) only with a bias.
        assert (i.counts["LDG"] > 0) == i.bias, i.name
        if family == "gemm_sm90_kernel":
            # The bias is staged in smem once per tile, then one 8-byte read per accumulator pair
            # for each of the two passes (preactivation, output).
            assert i.counts["LDS"] == (ACCUMULATORS[family] // 2 if i.bias else 0), i.name
        # erf / tanh (MUFU) only in the GELU instances, for each accumulator of the output pass,
        # not of the preactivation's (erff takes one exp, tanhf an exp and a reciprocal; ptxas
        # may duplicate them on two branches of the mma.sync stores, never more).
        extra = i.counts["MUFU"] - base.counts["MUFU"]
        per_element = {"none": 0, "relu": 0, "gelu": 1, "gelu_tanh": 2}[i.activation]
        once = per_element * ACCUMULATORS[family]
        assert once <= extra <= 2 * once if family == "gemm_sm80_kernel" else extra == once, (
            i.name, extra)

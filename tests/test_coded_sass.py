"""What the optimizer kernels with 8-bit states compiled to, checked without a GPU (cuobjdump -sass
on the built extension): in the layout that gives a codec block to one warp (coded_runs=2) the
only block barrier is the one that shares the step's coefficients before the loop, where the
two-warp layout (coded_runs=1) also has the barriers of the codec block reductions; neither uses
local memory."""

from __future__ import annotations

import re
from functools import cache

import pytest

import fusedamp
from fusedamp import _C
from tools.gemm_sass import file_sass, find_tool, opcodes

BUILT_ARCHS = ["sm_" + arch.replace(".", "") for arch in fusedamp.build_info()["cuda_archs"]]
# The kernel families with 8-bit states, and how their mangled names spell the codec and the runs.
FAMILIES = ("adamw_coded_kernel", "sgd_coded_kernel", "muon_coded_kernel")
INT8_RUNS = re.compile(r"StateCodecE2E(?:Lb[01]E)?Li([12])E")

pytestmark = [
    pytest.mark.skipif(not _C.cuda_compiled, reason="fusedamp._C was built without its CUDA kernels"),
    pytest.mark.skipif(
        find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
        reason="cuobjdump/nvdisasm missing: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm",
    ),
]


@cache
def int8_kernels() -> dict[tuple[str, str, int], list[str]]:
    """{(arch, family, runs): the opcodes of each such kernel} over the built extension."""
    found: dict[tuple[str, str, int], list[str]] = {}
    for (arch, name), code in file_sass(_C.__file__).items():
        family = next((f for f in FAMILIES if f in name), None)
        runs = INT8_RUNS.search(name)
        if family is not None and runs is not None:
            found.setdefault((arch, family, int(runs.group(1))), []).append(opcodes(code))
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("arch", BUILT_ARCHS)
def test_a_codec_block_per_warp_leaves_one_barrier(arch: str, family: str) -> None:
    kernels = int8_kernels()
    for runs, expected_barriers in ((2, lambda n: n == 1), (1, lambda n: n > 1)):
        instances = kernels.get((arch, family, runs))
        assert instances, f"no {family} with 8-bit states and {runs} runs in the {arch} code"
        for ops in instances:
            barriers = sum(op.startswith("BAR.SYNC") for op in ops)
            assert expected_barriers(barriers), (arch, family, runs, barriers)
            assert not any(op.startswith(("LDL", "STL")) for op in ops), (arch, family, runs, "local memory")

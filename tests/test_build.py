"""Facts of the build that no result test would notice: OpenMP in the CPU ops, the kernel
dispatch failing loudly on a combination it has no kernel for, ISA code kept in its builds, and a
GPU user never silently left with a CPU-only build."""

from __future__ import annotations

import bisect
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedamp
from fusedamp import _C


def test_cpu_ops_run_on_every_torch_thread() -> None:
    """A build without OpenMP still runs correctly, on one thread: only this test can tell."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _C.parallel_for_threads() == 2
        torch.set_num_threads(1)
        assert _C.parallel_for_threads() == 1
    finally:
        torch.set_num_threads(previous)
    assert fusedamp.build_info()["cpu_threads"] == torch.get_num_threads()


def test_build_info_reports_the_cache_the_cpu_optimizers_size_their_stores_by() -> None:
    """The L3 that Linux lists for cpu0 (sysconf's can be the whole socket's in a VM), else 32 MiB."""
    expected = 32 << 20
    size_path = "/sys/devices/system/cpu/cpu0/cache/index3/size"
    if os.path.exists(size_path):
        text = open(size_path).read().strip()
        expected = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    assert fusedamp.build_info()["cpu_cache_bytes"] == expected


@pytest.mark.parametrize(
    ("param_dtype", "master_kind", "picked"), [(0, 0, "0/0"), (1, 1, "1/1"), (2, 2, "2/2"), (2, 1, "2/1")]
)
def test_dispatch_picks_the_kernel_of_each_valid_combination(param_dtype, master_kind, picked) -> None:
    assert _C.testing.dispatch_for_test(param_dtype, master_kind) == picked


@pytest.mark.parametrize(
    ("param_dtype", "master_kind", "message"),
    [
        (0, 1, "no kernel for master kind 1 with param element type 0"),  # fp32 params, fp32 master
        (1, 2, "no kernel for master kind 2 with param element type 1"),  # fp16 params, remainder
        (3, 0, "no kernel for element type 3"),  # int16
        (2, 7, "no kernel for master kind 7"),
    ],
)
def test_dispatch_fails_loudly_instead_of_running_nothing(param_dtype, master_kind, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _C.testing.dispatch_for_test(param_dtype, master_kind)


# Instructions a baseline x86-64 CPU may lack: VEX/EVEX vector ones (all begin with "v", but for
# the old verr/verw), AVX-512 mask ones (all begin with "k") and BMI1/BMI2.
_BMI = set("andn bextr blsi blsmsk blsr bzhi mulx pdep pext rorx sarx shlx shrx".split())


def _needs_newer_cpu(mnemonic: str) -> bool:
    return (
        (mnemonic.startswith("v") and mnemonic not in ("verr", "verw"))
        or mnemonic.startswith("k")
        or (mnemonic in _BMI)
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA builds exist on x86-64 only")
def test_isa_code_stays_inside_the_isa_builds() -> None:
    """Every function of _C built for AVX2 or AVX-512 belongs to fusedamp's avx2/avx512 namespaces.
    A template instance or inline function compiled for an ISA outside them is one copy the
    linker shares with every build: the baseline code (and an AVX2 CPU) could then run AVX-512."""
    library = _C.__file__
    symbols = []
    nm = subprocess.run(
        ["nm", "-C", "-S", "--defined-only", library], capture_output=True, text=True, check=True
    )
    for line in nm.stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[2] in "tTwW":
            symbols.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    symbols.sort()
    starts = [start for start, _, _ in symbols]
    disassembly = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True, check=True
    ).stdout
    offenders: dict[str, str] = {}
    for line in disassembly.splitlines():
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip().endswith(":"):
            continue
        mnemonic = fields[1].split(" ", 1)[0]
        if not _needs_newer_cpu(mnemonic):
            continue
        address = int(fields[0].strip()[:-1], 16)
        index = bisect.bisect_right(starts, address) - 1
        inside = index >= 0 and address < symbols[index][0] + symbols[index][1]
        name = symbols[index][2] if inside else f"<no symbol at {address:#x}>"
        if "avx512" not in name and "avx2" not in name:
            offenders.setdefault(name, mnemonic)
    assert not offenders, f"ISA-specific instructions outside the ISA builds: {offenders}"


ROOT = Path(__file__).resolve().parents[1]
# What `setup.py --name` reads: itself, the metadata and the files it loads from the package.
BUILD_FILES = ("setup.py", "pyproject.toml", "README.md", "fusedamp/__init__.py", "fusedamp/_cuda_archs.py")
# torch as it looks on a machine with a GPU (run as sitecustomize, before setup.py imports torch).
_GPU_VISIBLE = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (9, 0)
"""


def run_setup(tmp: Path, gpu_visible: bool, **environment: str) -> subprocess.CompletedProcess[str]:
    """``python setup.py --name`` on a copy of the build files, with no nvcc anywhere (no CUDA_HOME,
    PATH without /usr/local/bin) and torch's GPU mocked as visible or not: the build's decision
    about the CUDA kernels, without compiling anything."""
    for name in BUILD_FILES:
        (tmp / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp / name)
    mock = tmp / "mock"
    mock.mkdir()
    if gpu_visible:
        (mock / "sitecustomize.py").write_text(_GPU_VISIBLE)
    unset = ("CUDA_HOME", "CUDA_PATH", "FUSEDAMP_CUDA")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    env.update(PATH="/usr/bin:/bin", PYTHONPATH=str(mock), **environment)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_visible_gpu_without_nvcc_stops_the_build_with_the_way_out(tmp_path: Path) -> None:
    """pip shows a build's output only when it fails: a CPU-only build on a GPU machine must fail."""
    done = run_setup(tmp_path, gpu_visible=True)
    assert done.returncode != 0
    assert "a GPU is visible but the CUDA kernels cannot be built: nvcc was not found" in done.stderr
    assert "FUSEDAMP_CUDA=0" in done.stderr
    assert not (tmp_path / "fusedamp" / "_build_meta.py").exists()


def test_fusedamp_cuda_0_builds_cpu_only_on_purpose_and_records_why(tmp_path: Path) -> None:
    done = run_setup(tmp_path, gpu_visible=True, FUSEDAMP_CUDA="0")
    assert done.returncode == 0, done.stderr
    assert "CUDA kernels off (FUSEDAMP_CUDA=0)" in done.stdout
    assert "CUDA_REASON = 'off (FUSEDAMP_CUDA=0)'" in (tmp_path / "fusedamp" / "_build_meta.py").read_text()


def test_without_a_gpu_or_nvcc_the_build_is_cpu_only_and_says_why(tmp_path: Path) -> None:
    done = run_setup(tmp_path, gpu_visible=False)
    assert done.returncode == 0, done.stderr
    assert "CUDA kernels off (nvcc was not found" in done.stdout


@pytest.mark.skipif(fusedamp.build_info()["cuda_compiled"], reason="this build has the CUDA kernels")
def test_cuda_tensors_in_a_build_without_cuda_kernels_get_the_cause_and_the_fix() -> None:
    """Every op has a CUDA kernel here: one that says this build has none, why, and how to rebuild
    (not the dispatcher's "Could not run 'fusedamp::unscale_' with arguments from the 'CUDA'
    backend"). Called through the dispatcher's CUDA entry, with CPU tensors: no GPU is needed."""
    ops = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fusedamp::")]
    assert ops and all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") for name in ops)
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"unscale_ got CUDA tensors, but this fusedamp was built without "
                       r"its CUDA kernels \(the build said: CUDA kernels off .*FUSEDAMP_CUDA=1 pip install"):
        torch.ops.fusedamp.unscale_.default.redispatch(cuda, [torch.ones(3)], torch.zeros(()), torch.ones(()))


def test_the_oldest_torch_is_the_same_in_the_build_the_package_and_the_docs() -> None:
    """setup.py's MIN_TORCH (what the build checks and tools/check_oldest_torch.sh tests) is what
    pyproject.toml requires and what README.md and docs/install.md promise."""
    found = re.search(r"^MIN_TORCH = \((\d+), (\d+)\)$", (ROOT / "setup.py").read_text(), re.MULTILINE)
    assert found, "setup.py declares MIN_TORCH = (major, minor)"
    oldest = f"{found.group(1)}.{found.group(2)}"
    assert f'dependencies = ["torch>={oldest}"]' in (ROOT / "pyproject.toml").read_text()
    for doc in ("README.md", "docs/install.md"):
        text = " ".join((ROOT / doc).read_text().split())  # prose wraps anywhere
        assert f"torch {oldest} or newer" in text, doc
        assert not re.search(r"torch \d+\.\d+ or newer", text.replace(f"torch {oldest} or newer", "")), doc
    assert f'TORCH="${{OLDEST_TORCH:-{oldest}.' in (ROOT / "tools" / "check_oldest_torch.sh").read_text()

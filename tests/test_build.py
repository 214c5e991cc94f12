"""Facts of the build that no result test would notice: OpenMP in the CPU ops, the kernel
dispatch failing loudly on a combination it has no kernel for, ISA code kept in its builds."""

from __future__ import annotations

import bisect
import os
import platform
import subprocess

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

"""tools/check_ptxas.py --log, CI's ptxas check, on made-up build logs (no nvcc needed): it reads the
sm_75 entries of a 7.5;8.0;9.0a build like the others (the empty mma.sync bodies included), fails
on a spill in any arch, and fails when a file has no report for an arch the build targets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools import check_ptxas
from tools.compile_cuda_file import SOURCES, gencode, split_archs

ROOT = Path(__file__).resolve().parents[1]
ARCHS = "7.5;8.0;9.0a"


def ptxas_report(kernel: str, sm: str, registers: int = 32, spills: int = 0) -> str:
    return (
        f"ptxas info    : Compiling entry function '{kernel}' for '{sm}'\n"
        f"ptxas info    : Function properties for {kernel}\n"
        f"    0 bytes stack frame, {spills} bytes spill stores, {spills} bytes spill loads\n"
        f"ptxas info    : Used {registers} registers, used 0 barriers, 432 bytes cmem[0]\n"
    )


def build_log(archs: str = ARCHS, skip: tuple[str, str] | None = None, spill: str | None = None) -> str:
    """A ninja log of a build from scratch for `archs`: one step per CUDA source with its ptxas
    report per arch, without the (file, sm) `skip`, with a spill in arch `spill`."""
    entries = split_archs(archs)
    flags = " ".join(flag for arch in entries for flag in gencode(arch))
    lines = []
    for step, source in enumerate(SOURCES, 1):
        nvcc = f"/usr/local/cuda/bin/nvcc -c {source} -o {source.stem}.o {flags}"
        lines.append(f"[{step}/{len(SOURCES)}] {nvcc}")
        for arch in entries:
            sm = check_ptxas.sm_name(arch)
            if skip == (source.name, sm):
                continue
            # Below sm_80 the mma.sync kernel is an empty body: 4 registers.
            registers = 4 if "sm80" in source.name and sm == "sm_75" else 96
            kernel = f"_ZN8fusedamp6kernelI{source.stem}EEvv"
            lines.append(ptxas_report(kernel, sm, registers, 16 if sm == spill else 0).rstrip("\n"))
    return "\n".join(lines) + "\n"


def run_check(log: str, tmp_path: Path, archs: str | None = ARCHS) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "build.log"
    path.write_text(log)
    env = {key: value for key, value in os.environ.items() if key != "TORCH_CUDA_ARCH_LIST"}
    if archs is not None:
        env["TORCH_CUDA_ARCH_LIST"] = archs
    return subprocess.run(
        [sys.executable, "-m", "tools.check_ptxas", "--log", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sm_75_entries_are_read_like_the_others(tmp_path: Path) -> None:
    done = run_check(build_log(), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for sm in ("sm_75", "sm_80", "sm_90a"):
        assert f"  {sm:7} regs" in done.stdout
    assert "sm_75   regs   4" in done.stdout  # the empty mma.sync bodies


def test_a_spill_in_sm_75_code_fails(tmp_path: Path) -> None:
    done = run_check(build_log(spill="sm_75"), tmp_path)
    assert done.returncode == 1 and "(sm_75) spills" in done.stderr


def test_a_file_without_its_sm_75_report_fails(tmp_path: Path) -> None:
    done = run_check(build_log(skip=("amp.cu", "sm_75")), tmp_path)
    assert done.returncode == 1
    assert "csrc/cuda/amp.cu: no ptxas report for sm_75" in done.stderr


def test_a_build_without_7_5_fails_when_ci_asks_for_it(tmp_path: Path) -> None:
    done = run_check(build_log("8.0;9.0a"), tmp_path)
    assert done.returncode == 1 and "no ptxas report for sm_75" in done.stderr
    # Without TORCH_CUDA_ARCH_LIST the log's own -gencode targets are the archs to cover.
    assert run_check(build_log("8.0;9.0a"), tmp_path, archs=None).returncode == 0

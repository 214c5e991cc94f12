"""The build's CUDA arch list (fusedamp/_cuda_archs.py, used by setup.py): 9.0a is added wherever
9.0 is targeted, so that a build on a Hopper machine has the wgmma kernel; and build_info()
reports the GEMM kernels a build has. No GPU or nvcc needed."""

from __future__ import annotations

import pytest
import torch.utils.cpp_extension as cpp_extension

import fusedamp
from fusedamp import _build_meta
from fusedamp._cuda_archs import (
    DEFAULT_ARCHS,
    NAMED_ARCHS,
    archs_too_old,
    detected_archs,
    gemm_kernels,
    oldest_arch,
    resolve_archs,
    split_arch_list,
)

TORCH_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@pytest.mark.parametrize(
    "requested,expected",
    [
        ("9.0", "9.0;9.0a"),
        ("9.0+PTX", "9.0+PTX;9.0a"),
        ("8.0 9.0", "8.0;9.0;9.0a"),
        ("Hopper", "9.0+PTX;9.0a"),
        ("8.0;9.0;9.0a", "8.0;9.0;9.0a"),
        ("9.0a", "9.0a"),
        ("8.0;8.6+PTX", "8.0;8.6+PTX"),
        ("10.0", "10.0"),
        ("7.5;8.0;9.0a", "7.5;8.0;9.0a"),
        ("7.5 8.0 9.0", "7.5;8.0;9.0;9.0a"),
        ("Turing;Hopper", "7.5+PTX;9.0+PTX;9.0a"),
    ],
)
def test_requested_list_gets_9_0a_when_it_targets_9_0(requested: str, expected: str) -> None:
    archs, note = resolve_archs(requested, [(9, 0)], TORCH_ARCHS)
    assert archs == expected
    assert (note is not None) == (archs != ";".join(split_arch_list(requested)))
    if note is not None:
        assert "9.0a" in note and requested in note


def test_visible_hopper_gpu_gets_9_0a() -> None:
    # torch alone would build 9.0+PTX here, and the wgmma kernel would compile empty.
    archs, note = resolve_archs(None, [(9, 0)], TORCH_ARCHS)
    assert archs == "9.0+PTX;9.0a"
    assert note is not None and "visible GPUs" in note
    assert resolve_archs("native", [(9, 0), (8, 0)], TORCH_ARCHS)[0] == "8.0;9.0+PTX;9.0a"


def test_visible_non_hopper_gpus_are_built_as_torch_would() -> None:
    assert resolve_archs("", [(8, 6), (8, 0), (8, 6)], TORCH_ARCHS) == ("8.0;8.6+PTX", None)
    # A GPU newer than torch's build is capped at the newest arch torch supports.
    assert detected_archs([(13, 0)], TORCH_ARCHS) == ["12.0+PTX"]


def test_visible_turing_gpu_is_built_for_7_5() -> None:
    # A T4 build machine: its own arch only (the GEMM kernels compile empty there), no 9.0a.
    assert resolve_archs(None, [(7, 5)], TORCH_ARCHS) == ("7.5+PTX", None)
    archs, note = resolve_archs(None, [(7, 5), (9, 0)], TORCH_ARCHS)
    assert archs == "7.5;9.0+PTX;9.0a" and note is not None
    assert gemm_kernels(resolve_archs(None, [(7, 5)], TORCH_ARCHS)[0]) == []


def test_no_gpu_and_no_list_builds_the_default() -> None:
    assert resolve_archs(None, [], []) == (DEFAULT_ARCHS, None)
    assert resolve_archs("native", [], []) == (DEFAULT_ARCHS, None)


def test_named_archs_expand_as_torch_expands_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch turns TORCH_CUDA_ARCH_LIST into -gencode flags without a GPU when the list is given.
    for name in NAMED_ARCHS:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", name)
        try:
            torch_flags = cpp_extension._get_cuda_arch_flags()
        except ValueError:  # a name whose archs this torch does not know
            continue
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", ";".join(split_arch_list(name)))
        assert cpp_extension._get_cuda_arch_flags() == torch_flags, name


@pytest.mark.parametrize(
    "arch_list,kernels",
    [
        ("8.0;9.0a", ["mma_sync", "wgmma"]),
        ("9.0", ["mma_sync"]),
        ("9.0+PTX;9.0a", ["mma_sync", "wgmma"]),
        ("7.5", []),
        ("7.5+PTX", []),
        ("Turing", []),
        ("7.0;7.5+PTX", []),
        ("7.5;8.0;9.0a", ["mma_sync", "wgmma"]),
        ("7.5;8.0", ["mma_sync"]),
        ("7.5;9.0a", ["mma_sync", "wgmma"]),
        ("8.6+PTX", ["mma_sync"]),
        ("Hopper", ["mma_sync"]),
        ("10.0a", ["mma_sync"]),
        ("", []),
    ],
)
def test_gemm_kernels_of_an_arch_list(arch_list: str, kernels: list[str]) -> None:
    assert gemm_kernels(arch_list) == kernels


def test_build_info_reports_this_builds_gemm_kernels() -> None:
    info = fusedamp.build_info()
    if not info["cuda_compiled"]:
        assert info["gemm_kernels"] == []
        return
    assert info["cuda_archs"] == _build_meta.CUDA_ARCHS.split(";")
    assert info["gemm_kernels"] == gemm_kernels(_build_meta.CUDA_ARCHS)
    # A build for 9.0 has 9.0a too (setup.py adds it), so it has the wgmma kernel.
    if "9.0" in {arch.removesuffix("+PTX") for arch in info["cuda_archs"]}:
        assert "wgmma" in info["gemm_kernels"]


@pytest.mark.parametrize(
    "arch_list,cuda_major,too_old",
    [
        ("7.5;8.0;9.0a", 13, []),
        ("7.0;7.5;8.0", 13, ["7.0"]),
        ("Volta;Turing", 13, ["7.0+PTX"]),
        ("Pascal", 13, ["6.0", "6.1+PTX"]),
        ("7.2", 13, ["7.2"]),
        ("7.0;8.0", 12, []),
        ("5.0", 12, []),
        ("7.0", 14, ["7.0"]),  # a newer CUDA: at least what CUDA 13 dropped
        ("7.0", 11, []),
    ],
)
def test_archs_cuda_13_cannot_build(arch_list: str, cuda_major: int, too_old: list[str]) -> None:
    # setup.py stops early with a clear message instead of nvcc's "Unsupported gpu architecture".
    assert archs_too_old(arch_list, cuda_major) == too_old
    assert oldest_arch(13) == (7, 5)

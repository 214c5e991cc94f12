"""The CUDA gemm's kernel choice (csrc/ops/gemm.cpp choose_kernel), on the host through
_C.testing.gemm_choose_kernel: every backend against every device / build / problem combination,
including devices this build has no code for (an 8.0-only build on Hopper, 8.0;9.0a on sm_100)."""

from __future__ import annotations

import itertools

import pytest

from fusedamp import _C

# (cc, mma_sync_code, wgmma_code): what a device and a build give the choice.
H100_FULL_BUILD = (90, True, True)  # 8.0;9.0a on sm_90
H100_WITHOUT_9_0A = (90, True, False)  # 9.0 (no "a") on sm_90: the wgmma body is empty
H100_8_0_BUILD = (90, False, False)  # 8.0 only on sm_90: sm_80 SASS does not run there
A100 = (80, True, False)
RTX4090 = (89, True, False)  # sm_80 SASS runs on sm_89
B200_OLD_BUILD = (100, False, False)  # 8.0;9.0a on sm_100: neither runs there
B200_WITH_PTX = (100, True, False)  # 8.0+PTX: the driver compiles the mma.sync PTX
V100 = (70, False, False)
# 7.5;8.0;9.0a on sm_75: its sm_75 image of the mma.sync kernel has an empty body (sm80.cuh), which
# sm80_kernels_built() does not count as code (the image's PTX version is below 8.0).
T4 = (75, False, False)
# 7.5+PTX on sm_86: the driver compiles the compute_75 PTX, an empty body as well.
RTX3090_TURING_PTX = (86, False, False)


# The wgmma backends: the schedule chosen per shape, or one forced (what the benchmark compares).
WGMMA_BACKENDS = ["wgmma", "wgmma_cooperative", "wgmma_pingpong"]


def choose(backend: str, device: tuple[int, bool, bool], fits: bool = True, wgmma_fits: bool = True):
    cc, mma_sync_code, wgmma_code = device
    return _C.testing.gemm_choose_kernel(backend, cc, mma_sync_code, wgmma_code, fits, wgmma_fits)


@pytest.mark.parametrize(
    "device,expected",
    [
        (H100_FULL_BUILD, ("wgmma", "")),
        (H100_WITHOUT_9_0A, ("mma_sync", "wgmma")),
        (H100_8_0_BUILD, ("reference", "mma_sync")),
        (A100, ("mma_sync", "")),
        (RTX4090, ("mma_sync", "")),
        (B200_OLD_BUILD, ("reference", "mma_sync")),
        (B200_WITH_PTX, ("mma_sync", "")),
        (V100, ("reference", "")),
        (T4, ("reference", "")),
        (RTX3090_TURING_PTX, ("reference", "mma_sync")),
    ],
)
def test_auto_takes_the_best_kernel_this_build_has_code_for(device, expected) -> None:
    assert choose("auto", device) == expected


def test_auto_warns_about_missing_wgmma_code_only_when_wgmma_would_run() -> None:
    # An fp32 output (or N not a multiple of 8) goes to mma.sync even with the wgmma code.
    assert choose("auto", H100_WITHOUT_9_0A, wgmma_fits=False) == ("mma_sync", "")
    assert choose("auto", H100_FULL_BUILD, wgmma_fits=False) == ("mma_sync", "")


def test_problems_the_kernels_cannot_take_use_the_reference() -> None:
    for backend, device in itertools.product(["auto", "mma_sync"], [H100_FULL_BUILD, A100, B200_WITH_PTX]):
        assert choose(backend, device, fits=False) == ("reference", "")
    for backend in WGMMA_BACKENDS:
        assert choose(backend, H100_FULL_BUILD, fits=False) == ("reference", "")
        assert choose(backend, H100_FULL_BUILD, wgmma_fits=False) == ("reference", "")


def test_forced_kernels_run_where_their_code_runs() -> None:
    assert choose("mma_sync", H100_FULL_BUILD) == ("mma_sync", "")
    assert choose("mma_sync", B200_WITH_PTX) == ("mma_sync", "")
    for backend in WGMMA_BACKENDS:
        assert choose(backend, H100_FULL_BUILD) == ("wgmma", "")


@pytest.mark.parametrize("device", [H100_8_0_BUILD, B200_OLD_BUILD])
def test_forced_mma_sync_without_code_for_the_device_is_an_error(device) -> None:
    message = r"no mma.sync code that runs on this sm_\d+ GPU.*TORCH_CUDA_ARCH_LIST"
    with pytest.raises(RuntimeError, match=message):
        choose("mma_sync", device)


def test_forced_mma_sync_before_ampere_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="needs an sm_80 or newer GPU; this is sm_70"):
        choose("mma_sync", V100)
    # Whatever a Turing build reports about its (empty) mma.sync image.
    for mma_sync_code in (False, True):
        with pytest.raises(RuntimeError, match="needs an sm_80 or newer GPU; this is sm_75"):
            choose("mma_sync", (75, mma_sync_code, False))


def test_auto_never_picks_a_kernel_below_ampere() -> None:
    # Even if a build reported mma.sync code for a Turing GPU, auto runs the reference there.
    for mma_sync_code, fits in itertools.product((False, True), (False, True)):
        assert choose("auto", (75, mma_sync_code, False), fits=fits) == ("reference", "")


@pytest.mark.parametrize("device", [H100_WITHOUT_9_0A, H100_8_0_BUILD, A100, B200_WITH_PTX, T4])
@pytest.mark.parametrize("backend", WGMMA_BACKENDS)
def test_forced_wgmma_without_its_code_is_an_error(device, backend) -> None:
    message = f"the {backend} backend needs an sm_90 GPU and a build for arch 9.0a"
    with pytest.raises(RuntimeError, match=message):
        choose(backend, device)


def test_reference_backend_never_asks_the_device() -> None:
    for device in (H100_FULL_BUILD, H100_8_0_BUILD, V100, T4):
        assert choose("reference", device) == ("reference", "")


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown gemm backend 'cublas'.*wgmma_pingpong"):
        choose("cublas", A100)

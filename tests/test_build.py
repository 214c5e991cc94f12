"""Facts of the build that no result test would notice: OpenMP in the CPU ops, the kernel
dispatch failing loudly on a combination it has no kernel for."""

from __future__ import annotations

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

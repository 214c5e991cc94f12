"""The host memo the GEMM launchers keep their TMA descriptors and kernel attributes in
(csrc/common/memo.h), through _C.testing.memo_trace: a value is made once per key and then reused,
a full memo forgets and remakes, and a make that fails keeps nothing."""

from __future__ import annotations

from fusedamp import _C


def test_each_key_is_made_once_and_reused() -> None:
    trace = _C.testing.memo_trace([1, 2, 1, 2, 3, 1], capacity=8, throw_on=-1)
    assert trace == [(True, 10), (True, 20), (False, 10), (False, 20), (True, 30), (False, 10)]


def test_a_full_memo_forgets_everything_and_remakes_on_demand() -> None:
    trace = _C.testing.memo_trace([1, 2, 3, 1, 3], capacity=2, throw_on=-1)
    # 3 finds the memo full (1, 2) and clears it before keeping 3; 1 is then remade, 3 is kept.
    assert [made for made, _ in trace] == [True, True, True, True, False]
    assert [value for _, value in trace] == [10, 20, 30, 10, 30]
    assert _C.testing.memo_trace([1, 2, 1, 2], capacity=2, throw_on=-1) == [
        (True, 10), (True, 20), (False, 10), (False, 20)]


def test_a_make_that_throws_keeps_nothing() -> None:
    trace = _C.testing.memo_trace([5, 5, 6, 6], capacity=8, throw_on=5)
    assert trace == [(True, -1), (True, -1), (True, 60), (False, 60)]

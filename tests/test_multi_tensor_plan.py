"""The multi-tensor launch planner (csrc/include/fusedamp/multi_tensor_plan.h), tested on CPU.

The CUDA launcher runs one block per chunk from this plan, each block finds its chunk with
locate_chunk from per-slot ranges, and the per-tensor reductions find each tensor's blocks with
tensor_block_ranges: all are checked here against a plain Python model.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedamp import _C

GRID_LIMIT = 2**31 - 1  # the most blocks one CUDA launch may have; the launcher plans with it


def expected_chunks(numels: list[int], chunk_size: int) -> Counter[tuple[int, int]]:
    return Counter(
        (tensor, chunk) for tensor, numel in enumerate(numels) for chunk in range(-(-numel // chunk_size))
    )


def check_plan(numels: list[int], chunk_size: int, max_tensors: int, max_blocks: int) -> list:
    """Asserts every property of the plan and of the blocks' own view of it; returns the plan."""
    blocks = _C.testing.plan_launches(numels, chunk_size, max_tensors, max_blocks)

    # Every chunk of every non-empty tensor exactly once, in list order; nothing else.
    assert Counter((tensor, chunk) for _, _, tensor, chunk in blocks) == expected_chunks(numels, chunk_size)
    assert [(t, c) for _, _, t, c in blocks] == sorted((t, c) for _, _, t, c in blocks)
    assert all(numels[tensor] > 0 for _, _, tensor, _ in blocks)

    by_launch: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for launch, slot, tensor, chunk in blocks:
        by_launch[launch].append((slot, tensor, chunk))
    assert sorted(by_launch) == list(range(len(by_launch)))
    for launch_blocks in by_launch.values():
        assert len(launch_blocks) <= max_blocks
        slots = [slot for slot, _, _ in launch_blocks]
        # Slots are numbered 0, 1, ... in block order, each holds one tensor, none is empty.
        assert slots == sorted(slots) and sorted(set(slots)) == list(range(len(set(slots))))
        assert len(set(slots)) <= max_tensors
        slot_tensor = {slot: tensor for slot, tensor, _ in launch_blocks}
        assert len(set(slot_tensor.values())) == len(slot_tensor)
        assert all(slot_tensor[slot] == tensor for slot, tensor, _ in launch_blocks)

    # A block's partial goes to its number across the launches (block_offset + blockIdx.x): the
    # per-tensor reductions read tensor t's partials at tensor_block_ranges' [first, first + count).
    ranges = _C.testing.tensor_block_ranges(numels, chunk_size)
    assert len(ranges) == len(numels)
    for tensor, (first, count) in enumerate(ranges):
        numbered = [(index, chunk) for index, (_, _, t, chunk) in enumerate(blocks) if t == tensor]
        assert numbered == [(first + chunk, chunk) for chunk in range(count)]
        assert count == -(-numels[tensor] // chunk_size)

    # What each block finds with locate_chunk is the plan's chunk, as element offsets.
    located = _C.testing.locate_chunks(numels, chunk_size, max_tensors, max_blocks)
    assert len(located) == len(blocks)
    for (launch, slot, tensor, chunk), where in zip(blocks, located, strict=True):
        begin = chunk * chunk_size
        assert where == (launch, slot, tensor, begin, min(chunk_size, numels[tensor] - begin))
    return blocks


@pytest.mark.parametrize(
    "numels",
    [
        [],
        [0],
        [0, 0, 0],
        [0, 5, 17],
        [5, 17, 0],
        [5, 0, 0, 17, 0, 3],
        [0, 16, 0, 32, 0],
        [1] * 40,
        [0, 1] * 20,
    ],
)
@pytest.mark.parametrize("max_tensors,max_blocks", [(1, 1), (2, 3), (3, 1000), (100, GRID_LIMIT)])
def test_zero_element_tensors_never_get_a_block(numels: list[int], max_tensors: int, max_blocks: int) -> None:
    check_plan(numels, 8, max_tensors, max_blocks)


def test_limits_split_launches_and_a_tensor_continues_in_the_next_launch() -> None:
    numels = [100, 3, 250, 0, 7]  # chunks of 16: 7, 1, 16, 0, 1
    blocks = check_plan(numels, 16, 2, 10)
    # Launch 0 holds tensors 0 and 1 (two slots); tensor 2 (16 chunks) fills launch 1 with ten
    # blocks and continues in launch 2, again in slot 0, followed by tensor 4 in slot 1.
    assert [(launch, slot, chunk) for launch, slot, tensor, chunk in blocks if tensor == 2] == [
        (1, 0, chunk) for chunk in range(10)
    ] + [(2, 0, chunk) for chunk in range(10, 16)]
    assert [(launch, slot) for launch, slot, tensor, _ in blocks if tensor == 4] == [(2, 1)]


def test_slot_limit_alone_splits_launches() -> None:
    blocks = check_plan([5] * 10, 8, 3, GRID_LIMIT)
    assert max(launch for launch, _, _, _ in blocks) == 3  # 10 tensors, 3 slots per launch


def test_tensor_larger_than_2_pow_31_elements_uses_64_bit_chunks() -> None:
    # Only element counts: nothing is allocated.
    big = 2**31 + 1000
    chunk_size = 2**16
    numels = [7, big, 0, 3 * 2**31 + 5]
    for max_blocks in (GRID_LIMIT, 5000):
        blocks = check_plan(numels, chunk_size, 4, max_blocks)
        last_of_big = max(chunk for _, _, tensor, chunk in blocks if tensor == 1)
        assert last_of_big == big // chunk_size
    located = _C.testing.locate_chunks(numels, chunk_size, 4, GRID_LIMIT)
    big_chunks = [(begin, count) for _, _, tensor, begin, count in located if tensor == 1]
    assert big_chunks[-1] == (2**31, 1000)
    huge_chunks = [(begin, count) for _, _, tensor, begin, count in located if tensor == 3]
    assert huge_chunks[-1] == (3 * 2**31, 5)
    assert sum(count for _, count in huge_chunks) == 3 * 2**31 + 5


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.one_of(st.just(0), st.integers(1, 200)), max_size=30),
    chunk_size=st.integers(1, 64),
    max_tensors=st.integers(1, 8),
    max_blocks=st.one_of(st.integers(1, 40), st.just(GRID_LIMIT)),
)
def test_any_list_is_planned_exactly(
    numels: list[int], chunk_size: int, max_tensors: int, max_blocks: int
) -> None:
    check_plan(numels, chunk_size, max_tensors, max_blocks)

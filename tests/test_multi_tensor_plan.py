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


# --- one launch per step ([note: kernel parameter budget]) -------------------------------------

H200_SMS = 132
SMALL_PARAMS, LARGE_PARAMS = 4096, 32764
DEFAULT_CHUNK = 2**16

# Every (master, codec, coded) mode an optimizer's CUDA kernels run: fp32 params; half params with
# an fp32 master or a bf16 remainder (a master list either way); bf16 or int8 states (coded);
# stochastically rounded half params without a master (coded, fp32 states).
OPTIMIZER_MODES = [
    (master, codec, coded)
    for master in (False, True)
    for codec, coded in (("float32", False), ("float32", True), ("bfloat16", True), ("int8", True))
]


def benchmark_step_numels() -> list[int]:
    """The parameter sizes of benchmarks/bench_optim.py's CUDA step: 64M elements in 200 tensors."""
    from benchmarks.bench_optim import DEFAULT_ELEMENTS, TENSORS, param_sizes

    return param_sizes(DEFAULT_ELEMENTS["cuda"], TENSORS)


@pytest.mark.parametrize("op", ["adamw", "sgd", "muon"])
@pytest.mark.parametrize("master,codec,coded", OPTIMIZER_MODES)
def test_benchmark_step_is_one_launch_that_covers_an_h200(
    op: str, master: bool, codec: str, coded: bool
) -> None:
    numels = benchmark_step_numels()
    assert len(numels) == 200 and sum(numels) == 64 << 20
    lists, args_bytes = _C.testing.optimizer_kernel_footprint(op, master, codec, coded)
    blocks = _C.testing.launch_blocks(numels, DEFAULT_CHUNK, lists, LARGE_PARAMS, args_bytes)
    assert len(blocks) == 1
    assert blocks[0] == sum(-(-n // DEFAULT_CHUNK) for n in numels) >= 4 * H200_SMS
    # The 4 KB fallback still plans every chunk, in more launches.
    small = _C.testing.launch_blocks(numels, DEFAULT_CHUNK, lists, SMALL_PARAMS, args_bytes)
    assert sum(small) == blocks[0] and len(small) > 1


def test_launches_carry_only_the_lists_their_mode_reads() -> None:
    footprint = _C.testing.optimizer_kernel_footprint
    # AdamW: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad, a run-time flag), step;
    # + master; + three scales for int8; + the rounding ids in the coded modes. Of 11 lists.
    assert footprint("adamw", False, "float32", False)[0] == 6
    assert footprint("adamw", True, "float32", False)[0] == 7
    assert footprint("adamw", True, "bfloat16", True)[0] == 8
    assert footprint("adamw", True, "int8", True)[0] == 11
    assert footprint("sgd", False, "float32", False)[0] == 4
    assert footprint("sgd", True, "int8", True)[0] == 7
    assert footprint("muon", False, "float32", False)[0] == 4


@pytest.mark.parametrize("chunk_size", [2**12, 2**14, 2**16, 2**18])
def test_grad_ops_step_is_one_launch_for_any_chunk_size(chunk_size: int) -> None:
    numels = benchmark_step_numels()
    # One list (the grads); the grad ops' own arguments are a few pointers (at most 32 bytes).
    blocks = _C.testing.launch_blocks(numels, chunk_size, 1, LARGE_PARAMS, 32)
    assert blocks == [sum(-(-n // chunk_size) for n in numels)]


def test_launch_settings_are_checked_and_restored() -> None:
    previous = _C.set_cuda_launch_settings(chunk_size=2**14, param_bytes=SMALL_PARAMS)
    try:
        assert previous == {"chunk_size": DEFAULT_CHUNK, "param_bytes": 0, "grad_unroll": 4, "coded_runs": 1}
        _C.set_cuda_launch_settings(grad_unroll=8, coded_runs=2)
        expected = {"chunk_size": 2**14, "param_bytes": SMALL_PARAMS, "grad_unroll": 8, "coded_runs": 2}
        assert _C.cuda_launch_settings() == expected
        for bad in (3000, 2**11, 2**25):
            with pytest.raises(ValueError, match="chunk_size"):
                _C.set_cuda_launch_settings(chunk_size=bad)
        with pytest.raises(ValueError, match="param_bytes"):
            _C.set_cuda_launch_settings(param_bytes=8192)
        with pytest.raises(ValueError, match="grad_unroll"):
            _C.set_cuda_launch_settings(grad_unroll=3)
        for bad in (0, 3):
            with pytest.raises(ValueError, match="coded_runs must be 1 or 2, got"):
                _C.set_cuda_launch_settings(coded_runs=bad)
        assert _C.cuda_launch_settings() == expected
    finally:
        _C.set_cuda_launch_settings(**previous)
    assert _C.cuda_launch_settings() == previous


@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("unroll", [2, 4, 8])
def test_strided_pieces_cover_an_iteration_once_with_coalesced_warps(element_bytes: int, unroll: int) -> None:
    threads = 256
    piece = 16 // element_bytes
    offsets = _C.testing.strided_pieces(element_bytes, unroll, threads)
    flat = [offset for thread in offsets for offset in thread]
    assert sorted(flat) == list(range(threads * unroll * piece))
    for thread in offsets:
        for u in range(unroll):  # each piece is 16 contiguous bytes
            first = thread[u * piece]
            assert thread[u * piece : (u + 1) * piece] == list(range(first, first + piece))
    for warp in range(threads // 32):  # piece u of a warp's 32 lanes: 512 consecutive bytes
        lanes = offsets[32 * warp : 32 * warp + 32]
        for u in range(unroll):
            starts = [lane[u * piece] for lane in lanes]
            assert starts == list(range(starts[0], starts[0] + 32 * piece, piece))


@pytest.mark.parametrize("runs", [1, 2])
def test_coded_layouts_give_each_codec_block_to_its_threads_with_coalesced_warps(runs: int) -> None:
    """The coded optimizer kernels' layout (256 threads, 4 values a run): the iteration covered once,
    each codec block (256 elements) held by 256 / (4 runs) consecutive threads, one warp with two
    runs, so that its scale is a reduction within the warp; each run 4 consecutive elements, and a
    warp's runs side by side (a warp access is contiguous)."""
    threads, run, block = 256, 4, 256
    offsets = _C.testing.coded_elements(runs, threads)
    flat = [offset for thread in offsets for offset in thread]
    assert sorted(flat) == list(range(threads * runs * run))
    block_threads = block // (runs * run)
    assert block_threads == (32 if runs == 2 else 64)
    for first_thread in range(0, threads, block_threads):
        held = sorted(o for thread in offsets[first_thread : first_thread + block_threads] for o in thread)
        first = held[0]
        assert first % block == 0 and held == list(range(first, first + block))
    for thread in offsets:
        for r in range(runs):
            start = thread[r * run]
            assert thread[r * run : (r + 1) * run] == list(range(start, start + run))
    for warp in range(threads // 32):
        lanes = offsets[32 * warp : 32 * warp + 32]
        for r in range(runs):
            starts = [lane[r * run] for lane in lanes]
            assert starts == list(range(starts[0], starts[0] + 32 * run, run))
    with pytest.raises(ValueError, match="runs must be 1 or 2"):
        _C.testing.coded_elements(3, threads)

"""The GEMM kernels' index math (csrc/include/fusedamp/gemm/tiles.h), run on the host: tile
schedules are bijections, swizzles are permutations that keep ldmatrix conflict-free, ldmatrix
feeds mma exactly the fragments it expects, and every output and k element is covered once."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from fusedamp import _C

SM80 = _C.testing.gemm_tiles()["sm80"]
SM90_TILES = {
    "cooperative": _C.testing.gemm_tiles()["sm90"],
    "pingpong": _C.testing.gemm_tiles()["sm90_pingpong"],
}
ODD_SHAPES = [(1, 1, 1), (7, 9, 13), (129, 65, 63), (257, 383, 100), (1000, 129, 4097)]


@pytest.mark.parametrize("tiles_m,tiles_n", [(1, 1), (3, 5), (9, 2), (17, 31), (64, 64)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_tile_schedule_is_a_bijection(tiles_m, tiles_n, group):
    tiles = _C.testing.gemm_tile_schedule(tiles_m, tiles_n, group)
    assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


@pytest.mark.parametrize("chunks_per_row,rows", [(4, 128), (16, 32)])
def test_sm80_swizzle_is_a_conflict_free_permutation(chunks_per_row, rows):
    offsets = _C.testing.gemm_swizzle(chunks_per_row, rows)
    assert sorted(offsets) == list(range(0, rows * chunks_per_row * 16, 16))
    for index, offset in enumerate(offsets):  # a chunk stays in its row
        assert offset // (chunks_per_row * 16) == index // chunks_per_row
    # One ldmatrix phase reads one logical chunk of 8 consecutive rows: 8 distinct bank groups.
    for r0 in range(0, rows, 8):
        for c in range(chunks_per_row):
            groups = {(offsets[(r0 + i) * chunks_per_row + c] // 16) % 8 for i in range(8)}
            assert len(groups) == 8
    # The cp.async stores: 8 consecutive chunks (one 128-byte phase) hit 8 distinct bank groups.
    for start in range(0, len(offsets), 8):
        assert len({(o // 16) % 8 for o in offsets[start : start + 8]}) == 8


def test_swizzle_128b_is_a_permutation_within_rows():
    offsets = _C.testing.gemm_swizzle_128b(8 * 1024)
    assert sorted(offsets) == list(range(0, 8 * 1024, 16))
    assert all(o // 128 == i * 16 // 128 for i, o in enumerate(offsets))
    # Column chunk c of 8 consecutive rows lands in 8 different bank groups.
    for row0 in range(0, 64, 8):
        for c in range(8):
            assert len({offsets[(row0 + r) * 8 + c] // 16 % 8 for r in range(8)}) == 8


def _ldmatrix(
    tile: torch.Tensor, lanes: list[tuple[int, int]], row0: int, chunk0: int, trans: bool
) -> list[list[tuple[int, int]]]:
    """What ldmatrix.x4 gives each lane: per register, two elements of `tile` (values are
    encoded positions). Lane i addresses row i % 8 of matrix i // 8."""
    out = [[] for _ in range(32)]
    for matrix in range(4):
        rows = []
        for r in range(8):
            row, chunk = lanes[matrix * 8 + r]
            rows.append(tile[row0 + row, 8 * (chunk0 + chunk) : 8 * (chunk0 + chunk) + 8])
        m = torch.stack(rows)  # (8, 8) as stored
        for lane in range(32):
            g, t = lane // 4, lane % 4
            pair = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
            out[lane].append(tuple(int(v) for v in pair))
    return out


def _encode(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols).reshape(rows, cols)


@pytest.mark.parametrize("k_major", [True, False])
def test_ldmatrix_a_feeds_the_mma_a_fragment(k_major):
    # A 16 (m) x 16 (k) block at (m0, k0) of a (BLK_M, BLK_K) K-major or (BLK_K, BLK_M) tile.
    m0, k0 = 16, 16
    stored = _encode(*((128, 32) if k_major else (32, 128)))
    lanes = _C.testing.gemm_ldmatrix_lanes("a", k_major)
    row0, chunk0 = (m0, k0 // 8) if k_major else (k0, m0 // 8)
    regs = _ldmatrix(stored, lanes, row0, chunk0, trans=not k_major)
    want = _C.testing.gemm_mma_elements("a")
    for lane in range(32):
        got = [v for pair in regs[lane] for v in pair]
        exp = []
        for m, k in want[lane]:
            exp.append(int(stored[m0 + m, k0 + k] if k_major else stored[k0 + k, m0 + m]))
        assert got == exp


@pytest.mark.parametrize("k_major", [True, False])
def test_ldmatrix_b_feeds_two_mma_b_fragments(k_major):
    n0, k0 = 32, 16
    stored = _encode(*((128, 32) if k_major else (32, 128)))
    lanes = _C.testing.gemm_ldmatrix_lanes("b", k_major)
    row0, chunk0 = (n0, k0 // 8) if k_major else (k0, n0 // 8)
    regs = _ldmatrix(stored, lanes, row0, chunk0, trans=not k_major)
    want = _C.testing.gemm_mma_elements("b")
    for lane in range(32):
        for block in range(2):  # registers (0, 1) -> n-block 0, (2, 3) -> n-block 1
            got = [v for pair in regs[lane][2 * block : 2 * block + 2] for v in pair]
            exp = []
            for k, n in want[lane]:
                nn = n0 + 8 * block + n
                exp.append(int(stored[nn, k0 + k] if k_major else stored[k0 + k, nn]))
            assert got == exp


def test_mma_fragments_cover_their_blocks_once():
    for operand, shape in (("a", (16, 16)), ("b", (16, 8)), ("c", (16, 8))):
        coords = [c for lane in _C.testing.gemm_mma_elements(operand) for c in lane]
        assert sorted(coords) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def test_mma_fragments_compute_a_matrix_product():
    """Per-lane fragments of the spec, multiplied as mma.m16n8k16 does, give A @ B."""
    a = torch.randn(16, 16, dtype=torch.float64)
    b = torch.randn(16, 8, dtype=torch.float64)
    fa, fb, fc = (_C.testing.gemm_mma_elements(x) for x in "abc")
    d = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        for m, n in fc[lane]:
            d[m, n] = sum(a[m, k] * b[k, n] for k in range(16))
    assert all(len(set(x)) == len(x) for x in fa + fb)
    torch.testing.assert_close(d, a @ b)


@pytest.mark.parametrize("chunks_per_row,rows", [(4, 128), (16, 32)])
def test_sm80_tile_copy_covers_each_chunk_once(chunks_per_row, rows):
    threads = SM80[3]
    rounds = rows * chunks_per_row // threads
    chunks = _C.testing.gemm_copy_chunks(threads, rounds, chunks_per_row)
    assert sorted(chunks) == [(r, c) for r in range(rows) for c in range(chunks_per_row)]


@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
def test_sm80_outputs_are_written_once(m, n, k):
    block_m, block_n, _, _ = SM80
    per_block = _C.testing.gemm_sm80_accumulators()
    assert sorted(per_block) == [(r, c) for r in range(block_m) for c in range(block_n)]
    written = Counter()
    for tm, tn in _C.testing.gemm_tile_schedule(math.ceil(m / block_m), math.ceil(n / block_n), 8):
        for r, c in per_block:
            row, col = tm * block_m + r, tn * block_n + c
            if row < m and col < n:
                written[row, col] += 1
    assert len(written) == m * n and set(written.values()) == {1}


@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_sm90_outputs_are_written_once(m, n, k, schedule):
    block_m, block_n, _, _ = SM90_TILES[schedule]
    ring = _C.testing.gemm_sm90_ring(schedule)
    slice_coords = _C.testing.gemm_wgmma_accumulators(block_n)
    assert sorted(slice_coords) == [(r, c) for r in range(64) for c in range(block_n)]
    tiles = _C.testing.gemm_tile_schedule(math.ceil(m / block_m), math.ceil(n / block_n), 8)
    # Which consumers compute a tile, and the first row of each one's slices in it.
    rows_per_consumer = 64 * ring["slices"]
    consumer_rows = [0] if schedule == "pingpong" else range(0, block_m, rows_per_consumer)
    assert len(consumer_rows) * rows_per_consumer == block_m
    covered = torch.zeros(m, n, dtype=torch.int32)
    for tm, tn in tiles:
        for first_row in consumer_rows:
            for piece in range(ring["slices"]):
                # TMA stores clip the box to the matrix; in-bounds parts are written once.
                r0, c0 = tm * block_m + first_row + piece * 64, tn * block_n
                covered[r0 : r0 + 64, c0 : c0 + block_n] += 1
    assert torch.equal(covered, torch.ones(m, n, dtype=torch.int32))


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_sm90_smem_fits_an_sm(schedule):
    ring = _C.testing.gemm_sm90_ring(schedule)
    block_m, block_n, block_k, _ = SM90_TILES[schedule]
    stage = (block_m + block_n) * block_k * 2
    assert ring["smem_bytes"] >= 1023 + ring["stages"] * stage + 2 * 64 * 128
    static = 2 * ring["stages"] * 8 + 2 * block_n * 4  # mbarriers, the consumers' bias rows
    assert ring["smem_bytes"] + static <= 227 * 1024  # the opt-in maximum of sm_90


def run_sm90_ring(schedule: str, tiles: int, block: int, grid: int, k_tiles: int, seed: int,
                  turns: bool = True) -> dict[int, list[int]]:
    """One CTA of the sm90 kernel as the kernel's loops run it, with the stage ring's mbarriers
    (parity waits), the wgmma groups (one k tile in flight) and the ping-pong turn barriers,
    interleaved at random. Fails on a wait that passes on a stale phase (a consumer reading a stage
    before its load, or the producer overwriting one still read) and on a deadlock. Returns the
    walk positions each consumer computed."""
    ring = _C.testing.gemm_sm90_ring(schedule)
    stages, readers = ring["stages"], ring["stage_readers"]
    positions = [j for j in range(tiles) if block + j * grid < tiles]
    full = [0] * stages  # completed phases (finished loads) of each stage's full barrier
    empty = [0] * stages  # completed phases of each stage's empty barrier
    empty_arrivals = [0] * stages
    turn_arrivals, turn_syncs = [0, 0], [0, 0]
    in_flight: list[int] = []  # loads issued, not finished
    computed: dict[int, list[int]] = {0: [], 1: []}

    def release(iteration: int) -> None:
        s = iteration % stages
        empty_arrivals[s] += 1
        if empty_arrivals[s] == readers:
            empty_arrivals[s] = 0
            empty[s] += 1

    def producer():
        for iteration in range(len(positions) * k_tiles):
            s, parity = iteration % stages, (iteration // stages) & 1
            yield lambda s=s, parity=parity: empty[s] % 2 != parity ^ 1  # try_wait.parity
            assert empty[s] == iteration // stages, f"load {iteration} overwrote a stage in use"
            in_flight.append(iteration)

    def consumer(c: int):
        first, step = ring["walks"][c]
        for j in positions[first::step]:
            if turns and schedule == "pingpong" and j > 0:
                yield lambda: turn_arrivals[c] > turn_syncs[c]
                turn_syncs[c] += 1
            for kt in range(k_tiles):
                iteration = j * k_tiles + kt
                s, parity = iteration % stages, (iteration // stages) & 1
                yield lambda s=s, parity=parity: full[s] % 2 != parity
                assert full[s] == iteration // stages + 1, f"consumer {c} read load {iteration} stale"
                if kt > 0:
                    release(iteration - 1)  # wgmma wait_group 1: the previous k tile is done
            release(j * k_tiles + k_tiles - 1)
            if turns and schedule == "pingpong" and j + 1 in positions:
                turn_arrivals[1 - c] += 1
            computed[c].append(j)

    rng = random.Random(seed)
    actors = [producer(), consumer(0), consumer(1)]
    waiting = [next(actor, None) for actor in actors]
    while any(w is not None for w in waiting) or in_flight:
        ready = [i for i, w in enumerate(waiting) if w is not None and w()]
        choices = ready + (["load"] if in_flight else [])
        assert choices, "deadlock"
        pick = rng.choice(choices)
        if pick == "load":
            iteration = in_flight.pop(rng.randrange(len(in_flight)))
            full[iteration % stages] += 1
        else:
            waiting[pick] = next(actors[pick], None)
    return computed


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("tiles,block,grid,k_tiles", [(1, 0, 1, 1), (2, 0, 2, 3), (7, 1, 3, 1),
                                                       (9, 0, 2, 2), (40, 5, 6, 4), (25, 0, 1, 13)])
def test_sm90_stage_ring_never_reads_a_stale_stage(schedule, tiles, block, grid, k_tiles):
    positions = [j for j in range(tiles) if block + j * grid < tiles]
    for seed in range(30):
        computed = run_sm90_ring(schedule, tiles, block, grid, k_tiles, seed)
        if schedule == "cooperative":  # both consumers compute every tile, 64 rows each
            assert computed[0] == computed[1] == positions
        else:  # the consumers take turns
            assert sorted(computed[0] + computed[1]) == positions
            assert computed[0] == positions[0::2] and computed[1] == positions[1::2]


def test_sm90_pingpong_needs_its_turns():
    # Without the turn barriers a consumer can wait on a stage two loads early, and the parity wait
    # passes on the older phase: the simulation above catches it.
    with pytest.raises(AssertionError, match="stale"):
        for seed in range(200):
            run_sm90_ring("pingpong", 25, 0, 1, 13, seed, turns=False)


def test_sm90_schedule_choice():
    choose = _C.testing.gemm_sm90_schedule
    # Cooperative tiles are 128 x 256: 1024 x 1024 makes 32 of them, too few for 132 SMs.
    assert choose("wgmma", 1024, 1024, 132) == "pingpong"
    assert choose("wgmma", 2048, 2048, 132) == "pingpong"  # 128 tiles
    assert choose("wgmma", 4096, 4096, 132) == "cooperative"  # 512 tiles
    assert choose("wgmma", 128 * 12, 256 * 11, 132) == "cooperative"  # exactly one per SM
    assert choose("wgmma", 128 * 12, 256 * 11 - 1, 131) == "cooperative"
    assert choose("wgmma", 128 * 12, 256 * 11, 133) == "pingpong"
    assert choose("auto", 1, 8, 132) == "pingpong"
    for m, n in [(1024, 1024), (8192, 8192), (16384, 4096)]:
        assert choose("wgmma_cooperative", m, n, 132) == "cooperative"
        assert choose("wgmma_pingpong", m, n, 132) == "pingpong"


@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
@pytest.mark.parametrize("k_major", [True, False])
def test_sm80_k_is_read_once_and_the_tail_is_zero_filled(m, n, k, k_major):
    """Over all k-tiles, every k < K is loaded exactly once and every k >= K is zero-filled
    (K-major: k is the contiguous index inside chunks; MN-major: k is the row index)."""
    block_k = SM80[2]
    loaded = Counter()
    for kk in range(math.ceil(k / block_k) * block_k):
        if k_major:
            valid_bytes = _C.testing.gemm_chunk_bytes(0, kk - kk % 8, 1, k)
            is_loaded = (kk % 8) * 2 < valid_bytes
        else:
            is_loaded = _C.testing.gemm_chunk_bytes(kk, 0, k, 8) == 16
        if is_loaded:
            loaded[kk] += 1
    assert sorted(loaded) == list(range(k)) and set(loaded.values()) == {1}


def test_chunk_bytes_clips_rows_and_columns():
    assert _C.testing.gemm_chunk_bytes(0, 0, 1, 100) == 16
    assert _C.testing.gemm_chunk_bytes(0, 96, 1, 100) == 8
    assert _C.testing.gemm_chunk_bytes(0, 104, 1, 100) == 0
    assert _C.testing.gemm_chunk_bytes(1, 0, 1, 100) == 0


def test_wgmma_descriptor_fields():
    desc = _C.testing.gemm_wgmma_descriptor(0x1_2340, 8192, 1024)
    assert desc & 0x3FFF == 0x1_2340 >> 4
    assert (desc >> 16) & 0x3FFF == 8192 >> 4
    assert (desc >> 32) & 0x3FFF == 1024 >> 4
    assert (desc >> 49) & 0x7 == 0  # 1024-aligned swizzle atoms: no base offset
    assert desc >> 62 == 1  # 128-byte swizzle


@pytest.mark.parametrize(
    "activation,reference",
    [
        (0, lambda z: z),
        (1, F.relu),
        (2, F.gelu),
        (3, lambda z: F.gelu(z, approximate="tanh")),
    ],
)
def test_epilogue_activation_matches_torch(activation, reference):
    z = torch.linspace(-8, 8, 1001)
    got = torch.tensor(_C.testing.gemm_activation(z.tolist(), activation))
    torch.testing.assert_close(got, reference(z), rtol=1e-6, atol=1e-6)

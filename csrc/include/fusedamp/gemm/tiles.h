// Index math of the GEMM kernels (tile schedule, smem swizzles, ldmatrix/mma fragment maps, wgmma
// descriptors, epilogue activations) as host+device functions, so CPU tests check what GPUs run.
#pragma once

#include <math.h>
#include <stdint.h>

#include "fusedamp/macros.h"

namespace fusedamp::gemm {

// Epilogue activation, applied to acc + bias in fp32. The values are part of the kernel params.
enum class Activation : int32_t { kNone = 0, kRelu = 1, kGelu = 2, kGeluTanh = 3 };

// The activation as a kernel instance applies it: fixed at compile time, so that an instance holds
// the code of its own activation only.
template <Activation kAct>
FUSEDAMP_HOST_DEVICE float activate(float z) {
  if constexpr (kAct == Activation::kRelu) {
    return z > 0.f ? z : 0.f;
  } else if constexpr (kAct == Activation::kGelu) {
    return 0.5f * z * (1.f + erff(z * 0.70710678118654752f));
  } else if constexpr (kAct == Activation::kGeluTanh) {
    const float inner = 0.79788456080286536f * (z + 0.044715f * z * z * z);
    return 0.5f * z * (1.f + tanhf(inner));
  } else {
    return z;
  }
}

// The same activation chosen at run time (host tests).
FUSEDAMP_HOST_DEVICE float activate(float z, Activation act) {
  switch (act) {
    case Activation::kRelu:
      return activate<Activation::kRelu>(z);
    case Activation::kGelu:
      return activate<Activation::kGelu>(z);
    case Activation::kGeluTanh:
      return activate<Activation::kGeluTanh>(z);
    default:
      return activate<Activation::kNone>(z);
  }
}

struct TileCoord {
  int32_t m;  // tile row: output rows [m * BLK_M, (m + 1) * BLK_M)
  int32_t n;  // tile column: output columns [n * BLK_N, (n + 1) * BLK_N)
};

FUSEDAMP_HOST_DEVICE int32_t ceil_div(int64_t a, int64_t b) { return int32_t((a + b - 1) / b); }

// Linear tile index -> tile. Tiles are visited in bands of `group` tile rows, column by column
// inside a band, so CTAs running at the same time share A rows and B columns in L2. A bijection
// of [0, tiles_m * tiles_n) for any group >= 1 (the last band may be narrower).
FUSEDAMP_HOST_DEVICE TileCoord tile_of(int32_t linear, int32_t tiles_m, int32_t tiles_n,
                                       int32_t group) {
  const int32_t per_band = group * tiles_n;
  const int32_t band = linear / per_band;
  const int32_t first_m = band * group;
  const int32_t rows = tiles_m - first_m < group ? tiles_m - first_m : group;
  const int32_t in_band = linear - band * per_band;
  return {first_m + in_band % rows, in_band / rows};
}

// --- shared memory swizzles --------------------------------------------------------------------
// A smem tile is `rows` rows of `chunks_per_row` 16-byte chunks (8 half elements each). Chunk c of
// row r is stored at chunk swizzle_chunk(r, c) of the same row. XOR-ing the chunk with row bits
// makes the 8 row addresses of one ldmatrix phase (same logical chunk, 8 consecutive rows) land in
// 8 different 16-byte bank groups of a 128-byte line, so neither ldmatrix nor the cp.async stores
// conflict. Rows of 4 chunks (64 B) share a 128-byte line in pairs, hence the r >> 1.
template <int kChunksPerRow>
FUSEDAMP_HOST_DEVICE int32_t swizzle_chunk(int32_t row, int32_t chunk) {
  static_assert(kChunksPerRow == 4 || kChunksPerRow % 8 == 0,
                "swizzle_chunk: rows must be 64 bytes or a multiple of 128 bytes");
  if constexpr (kChunksPerRow == 4) {
    return chunk ^ ((row >> 1) & 3);
  } else {
    return chunk ^ (row & 7);
  }
}

// Byte offset of element `col` of row `row` in a swizzled tile of 16-bit elements.
template <int kChunksPerRow>
FUSEDAMP_HOST_DEVICE int32_t swizzled_offset(int32_t row, int32_t col) {
  return row * kChunksPerRow * 16 + swizzle_chunk<kChunksPerRow>(row, col >> 3) * 16 + (col & 7) * 2;
}

// The TMA SWIZZLE_128B pattern (also the wgmma 128B canonical layout): in every 1024-byte block,
// 16-byte chunk c of 128-byte row r sits at chunk c ^ (r % 8). Argument and result: byte offsets
// from a 1024-byte aligned base.
FUSEDAMP_HOST_DEVICE int32_t swizzle_128b(int32_t offset) {
  return offset ^ (((offset >> 7) & 7) << 4);
}

// --- global -> shared copies ------------------------------------------------------------------
// In copy round `round`, thread `thread` of `threads` copies chunk thread + round * threads of a
// tile, counted row by row.
struct ChunkIndex {
  int32_t row;
  int32_t chunk;
};
FUSEDAMP_HOST_DEVICE ChunkIndex copy_chunk(int32_t thread, int32_t round, int32_t threads,
                                           int32_t chunks_per_row) {
  const int32_t index = thread + round * threads;
  return {index / chunks_per_row, index % chunks_per_row};
}

// How many bytes of the 8-element chunk starting at (row, col) of a rows x cols matrix of 16-bit
// elements lie inside the matrix (the rest is zero-filled by the copy).
FUSEDAMP_HOST_DEVICE int32_t chunk_bytes(int64_t row, int64_t col, int64_t rows, int64_t cols) {
  if (row >= rows || col >= cols) return 0;
  return cols - col >= 8 ? 16 : int32_t(cols - col) * 2;
}

// --- mma.sync m16n8k16 fragments ---------------------------------------------------------------
// Where an ldmatrix.x4 lane points: row `row` and 16-byte chunk `chunk` of the operand's smem
// tile, relative to the fragment's first row and first chunk.

// A operand, 16x16 block. K-major (smem rows are m, 8 k per chunk; plain ldmatrix): matrices
// 0..3 are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15), i.e. registers
// a0..a3 of the mma. M-major (smem rows are k, 8 m per chunk; ldmatrix.trans): the same four
// matrices read transposed from rows k, chunks m.
FUSEDAMP_HOST_DEVICE ChunkIndex ldmatrix_a_lane(int32_t lane, bool k_major) {
  const int32_t matrix = lane >> 3;
  const int32_t row = lane & 7;
  if (k_major) return {row + 8 * (matrix & 1), matrix >> 1};
  return {row + 8 * (matrix >> 1), matrix & 1};
}

// B operand, two adjacent 16(k)x8(n) blocks. Matrices 0..3 are b0, b1 of n-block 0 and b0, b1 of
// n-block 1: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15). K-major smem rows
// are n (plain ldmatrix); N-major smem rows are k (ldmatrix.trans).
FUSEDAMP_HOST_DEVICE ChunkIndex ldmatrix_b_lane(int32_t lane, bool k_major) {
  const int32_t matrix = lane >> 3;
  const int32_t row = lane & 7;
  if (k_major) return {row + 8 * (matrix >> 1), matrix & 1};
  return {row + 8 * (matrix & 1), matrix >> 1};
}

struct Coord {
  int32_t row;
  int32_t col;
};

// Element `index` (0..7) of lane `lane`'s A fragment of mma.m16n8k16: (m, k) in the 16x16 block.
// Register index / 2 holds elements 2*(index/2) and +1 (low half first).
FUSEDAMP_HOST_DEVICE Coord mma_a_element(int32_t lane, int32_t index) {
  const int32_t reg = index >> 1;
  return {(lane >> 2) + 8 * (reg & 1), 2 * (lane & 3) + (index & 1) + 8 * (reg >> 1)};
}

// Element `index` (0..3) of lane `lane`'s B fragment: (k, n) in the 16x8 block.
FUSEDAMP_HOST_DEVICE Coord mma_b_element(int32_t lane, int32_t index) {
  return {2 * (lane & 3) + (index & 1) + 8 * (index >> 1), lane >> 2};
}

// Accumulator `index` (0..3) of lane `lane` for a 16x8 mma tile, and equally of every 8-column
// group of a wgmma m64nN tile (rows offset by 16 per warp of the warpgroup): (m, n).
FUSEDAMP_HOST_DEVICE Coord mma_c_element(int32_t lane, int32_t index) {
  return {(lane >> 2) + 8 * (index >> 1), 2 * (lane & 3) + (index & 1)};
}

// --- sm80 kernel tiling ------------------------------------------------------------------------
struct Sm80Tile {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kBlockK = 32;
  static constexpr int kStages = 4;
  static constexpr int kWarpsM = 2;
  static constexpr int kWarpsN = 4;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpM = kBlockM / kWarpsM;  // 64 rows per warp
  static constexpr int kWarpN = kBlockN / kWarpsN;  // 32 columns per warp
  static constexpr int kMmaM = kWarpM / 16;         // 4 mma tiles down
  static constexpr int kMmaN = kWarpN / 8;          // 4 mma tiles across
};

// Output element of accumulator `index` (0..3) of mma tile (mi, ni) of warp `warp`, lane `lane`,
// relative to the block tile's corner.
FUSEDAMP_HOST_DEVICE Coord sm80_accumulator(int32_t warp, int32_t lane, int32_t mi, int32_t ni,
                                            int32_t index) {
  const Coord c = mma_c_element(lane, index);
  const int32_t warp_m = warp % Sm80Tile::kWarpsM;
  const int32_t warp_n = warp / Sm80Tile::kWarpsM;
  return {warp_m * Sm80Tile::kWarpM + mi * 16 + c.row, warp_n * Sm80Tile::kWarpN + ni * 8 + c.col};
}

// --- sm90 kernel tiling ------------------------------------------------------------------------
// How the sm90 kernel's two consumer warpgroups share the output tiles.
enum class Sm90Schedule : int32_t {
  // Both consumers compute each 128 x 256 tile, 64 rows each, and store it together: the fewest
  // operand bytes per FLOP, but the Tensor Cores idle while a tile is stored.
  kCooperative = 0,
  // Each consumer computes whole 128 x 128 tiles and the two take turns: one stores its tile while
  // the other's main loop runs, and a problem has twice the tiles to spread over the SMs.
  kPingpong = 1,
};

// What both schedules share: one producer warpgroup, two consumer warpgroups, 64-wide k tiles.
struct Sm90TileCommon {
  static constexpr int kBlockK = 64;     // one 128-byte swizzle row of 16-bit elements
  static constexpr int kConsumers = 2;   // warpgroups running wgmma
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kBoxMn = 64;      // MN extent of one TMA box of an MN-major operand
  static constexpr int kStoreRows = 64;  // epilogue TMA store box: 64 rows x 128 bytes
};

template <Sm90Schedule kSchedule>
struct Sm90Tile : Sm90TileCommon {
  static constexpr bool kCooperative = kSchedule == Sm90Schedule::kCooperative;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kCooperative ? 256 : 128;
  // Output rows a consumer computes per tile, in wgmma m64 slices.
  static constexpr int kConsumerRows = kCooperative ? kBlockM / kConsumers : kBlockM;
  static constexpr int kSlices = kConsumerRows / 64;
  // As many stages as fit in 227 KiB of smem beside the consumers' staging buffers.
  static constexpr int kStages = kCooperative ? 4 : 6;
  // Consumers that read each stage, i.e. arrivals that free it for the next load.
  static constexpr int kStageReaders = kCooperative ? kConsumers : 1;
  static constexpr int kSmemBytes =
      1024 + kStages * (kBlockM + kBlockN) * kBlockK * 2 + kConsumers * kStoreRows * 128;
};

// Consumer `consumer`'s share of its CTA's tiles: walk positions first, first + step, ... Position
// j is linear tile blockIdx.x + j * gridDim.x, and its k tile kt is load j * k_tiles + kt of the
// stage ring. Ping-pong consumers alternate, and one starts a main loop only when the other's
// previous one is done, so that a consumer never waits on a stage more than one load ahead of
// the last load it saw finish there (an mbarrier parity wait cannot tell those apart).
struct Sm90Walk {
  int32_t first;
  int32_t step;
};
FUSEDAMP_HOST_DEVICE Sm90Walk sm90_consumer_walk(Sm90Schedule schedule, int32_t consumer) {
  if (schedule == Sm90Schedule::kCooperative) return {0, 1};
  return {consumer, Sm90TileCommon::kConsumers};
}

// The schedule of an (m, n) output on `sm_count` SMs when the caller leaves it to the kernel:
// ping-pong where cooperative tiles would leave SMs idle (its tiles are half as wide, so up to
// twice the SMs work and each hides its stores), cooperative where its tiles fill every SM.
FUSEDAMP_HOST_DEVICE Sm90Schedule choose_sm90_schedule(int64_t m, int64_t n, int32_t sm_count) {
  using Cooperative = Sm90Tile<Sm90Schedule::kCooperative>;
  const int64_t tiles =
      int64_t(ceil_div(m, Cooperative::kBlockM)) * ceil_div(n, Cooperative::kBlockN);
  return tiles < sm_count ? Sm90Schedule::kPingpong : Sm90Schedule::kCooperative;
}

// Output element of accumulator `index` (0 .. N / 2 - 1) of consumer thread `thread` (0..127) of
// a wgmma m64nNk16 tile: (m, n) relative to its 64-row slice.
FUSEDAMP_HOST_DEVICE Coord wgmma_accumulator(int32_t thread, int32_t index) {
  const Coord c = mma_c_element(thread & 31, index & 3);
  return {16 * (thread >> 5) + c.row, 8 * (index >> 2) + c.col};
}

// wgmma shared memory matrix descriptor for a 128B-swizzled operand starting at smem byte address
// `address` (in a 1024-byte aligned swizzle pattern). `leading` and `stride` are the PTX "leading
// dimension" and "stride dimension" byte offsets: for K-major operands stride is the step between
// 8-row groups and leading is unused; for MN-major ones leading is the step between 64-element
// MN blocks and stride the step between 8-row k groups.
FUSEDAMP_HOST_DEVICE uint64_t wgmma_descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  auto encode = [](uint32_t x) { return uint64_t((x & 0x3FFFF) >> 4); };
  return encode(address) | encode(leading) << 16 | encode(stride) << 32 | uint64_t(1) << 62;
}

}  // namespace fusedamp::gemm

// The sm_80+ GEMM kernel: mma.sync m16n8k16 (HMMA) fed by ldmatrix from XOR-swizzled shared
// memory, filled by a kStages-deep cp.async pipeline. Included once per input type (sm80_*.cu).
// cp.async and mma.sync m16n8k16 need sm_80: in code for an older arch (7.5 in a build that also
// serves Turing GPUs) the kernel body compiles to nothing, as the sm90 kernel's does outside
// sm_90a. sm80_kernels_built() (sm80_fp16.cu) tells such an image from the real one, so the gemm
// never launches it: below sm_80 it runs the ATen reference.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "cuda/gemm/device.cuh"
#include "cuda/gemm/launch.h"

namespace fusedamp::gemm {

// One operand's smem tile for a block extent `kMn` (BLK_M or BLK_N) and BLK_K. K-major operands
// are stored as (kMn, BLK_K): rows of BLK_K / 8 chunks; MN-major ones as (BLK_K, kMn).
template <bool kKMajor, int kMn>
struct Sm80Operand {
  static constexpr int kRows = kKMajor ? kMn : Sm80Tile::kBlockK;
  static constexpr int kChunksPerRow = (kKMajor ? Sm80Tile::kBlockK : kMn) / 8;
  static constexpr int kBytes = kRows * kChunksPerRow * 16;
  static constexpr int kCopyRounds = kRows * kChunksPerRow / Sm80Tile::kThreads;
  static_assert(kRows * kChunksPerRow % Sm80Tile::kThreads == 0,
                "Sm80Operand: every thread copies the same number of chunks");

  // Starts the copy of the tile whose first (m or n, k) element is (mn0, k0). `base` holds the
  // operand as `extent_mn` x `extent_k` with leading dimension `ld`.
  static __device__ __forceinline__ void load(uint32_t smem, const uint16_t* base, int64_t ld,
                                              int32_t extent_mn, int32_t extent_k, int32_t mn0,
                                              int32_t k0) {
    // Rows and columns of the tile as stored: rows along the strided index.
    const int32_t row0 = kKMajor ? mn0 : k0;
    const int32_t col0 = kKMajor ? k0 : mn0;
    const int32_t rows = kKMajor ? extent_mn : extent_k;
    const int32_t cols = kKMajor ? extent_k : extent_mn;
#pragma unroll
    for (int round = 0; round < kCopyRounds; ++round) {
      const ChunkIndex c = copy_chunk(threadIdx.x, round, Sm80Tile::kThreads, kChunksPerRow);
      const int64_t row = row0 + c.row;
      const int64_t col = col0 + c.chunk * 8;
      const int32_t bytes = chunk_bytes(row, col, rows, cols);
      const uint16_t* src = bytes > 0 ? base + row * ld + col : base;
      cp_async_16(smem + swizzled_offset<kChunksPerRow>(c.row, c.chunk * 8), src, bytes);
    }
  }

  // smem byte offset that lane `lane` hands to ldmatrix for the fragment whose first (mn, k)
  // element of the tile is (mn, k); `lane_address` is ldmatrix_a_lane / ldmatrix_b_lane.
  static __device__ __forceinline__ uint32_t fragment_offset(ChunkIndex lane_address, int32_t mn,
                                                             int32_t k) {
    const int32_t row = (kKMajor ? mn : k) + lane_address.row;
    const int32_t chunk = (kKMajor ? k : mn) / 8 + lane_address.chunk;
    return swizzled_offset<kChunksPerRow>(row, chunk * 8);
  }
};

// Stores the column pair (v0, v1) at element `offset` of `dst`, fp32 when `out_fp32` else the
// input type T: one vector store when `vector` (the pair is whole and aligned), else element by
// element, v1 only when `has_second`.
template <typename T>
__device__ __forceinline__ void store_pair(void* dst, int64_t offset, float v0, float v1,
                                           bool has_second, bool vector, bool out_fp32) {
  using Traits = HalfTraits<T>;
  if (out_fp32) {
    float* out = static_cast<float*>(dst) + offset;
    if (vector) {
      *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
    } else {
      out[0] = v0;
      if (has_second) out[1] = v1;
    }
  } else {
    T* out = static_cast<T*>(dst) + offset;
    if (vector) {
      *reinterpret_cast<typename Traits::Pair*>(out) = Traits::pack(v0, v1);
    } else {
      out[0] = Traits::from_float(v0);
      if (has_second) out[1] = Traits::from_float(v1);
    }
  }
}

// One instance per input type, operand layouts and epilogue (bias or not, activation).
template <typename T, bool kAKMajor, bool kBKMajor, bool kBias, Activation kAct>
__global__ void __launch_bounds__(Sm80Tile::kThreads, 2) gemm_sm80_kernel(const GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using Tile = Sm80Tile;
  using OperandA = Sm80Operand<kAKMajor, Tile::kBlockM>;
  using OperandB = Sm80Operand<kBKMajor, Tile::kBlockN>;
  constexpr int kStageBytes = OperandA::kBytes + OperandB::kBytes;
  static_assert(Tile::kBlockK % 16 == 0, "gemm_sm80_kernel: BLK_K must be a multiple of mma K");
  static_assert(Tile::kMmaN % 2 == 0, "gemm_sm80_kernel: B fragments load two n-blocks at once");

  extern __shared__ __align__(128) uint8_t smem[];  // kStages x [(A tile) (B tile)]
  const uint32_t smem_base = smem_address(smem);

  const TileCoord tile = tile_of(blockIdx.x, ceil_div(p.m, Tile::kBlockM),
                                 ceil_div(p.n, Tile::kBlockN), 8);
  const int32_t m0 = tile.m * Tile::kBlockM;
  const int32_t n0 = tile.n * Tile::kBlockN;
  const int32_t k_tiles = ceil_div(p.k, Tile::kBlockK);
  const auto* a = static_cast<const uint16_t*>(p.a);
  const auto* b = static_cast<const uint16_t*>(p.b);

  auto load_stage = [&](int32_t k_tile) {
    const uint32_t stage = smem_base + (k_tile % Tile::kStages) * kStageBytes;
    OperandA::load(stage, a, p.lda, p.m, p.k, m0, k_tile * Tile::kBlockK);
    OperandB::load(stage + OperandA::kBytes, b, p.ldb, p.n, p.k, n0, k_tile * Tile::kBlockK);
  };

  // Every iteration commits one group (possibly empty), so "group kt has landed" is always
  // "at most kStages - 2 groups pending".
#pragma unroll
  for (int s = 0; s < Tile::kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }

  const int32_t warp = threadIdx.x / 32;
  const int32_t lane = threadIdx.x % 32;
  const int32_t warp_m0 = (warp % Tile::kWarpsM) * Tile::kWarpM;
  const int32_t warp_n0 = (warp / Tile::kWarpsM) * Tile::kWarpN;
  const ChunkIndex a_lane = ldmatrix_a_lane(lane, kAKMajor);
  const ChunkIndex b_lane = ldmatrix_b_lane(lane, kBKMajor);

  float acc[Tile::kMmaM][Tile::kMmaN][4] = {};  // (WARP_M / 16, WARP_N / 8, 4) per lane

  for (int32_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Tile::kStages - 2>();
    // Publishes stage kt to every warp and ends every warp's reads of the stage refilled below.
    __syncthreads();
    if (kt + Tile::kStages - 1 < k_tiles) load_stage(kt + Tile::kStages - 1);
    cp_async_commit();

    const uint32_t stage_a = smem_base + (kt % Tile::kStages) * kStageBytes;
    const uint32_t stage_b = stage_a + OperandA::kBytes;
#pragma unroll
    for (int kk = 0; kk < Tile::kBlockK; kk += 16) {
      uint32_t a_frag[Tile::kMmaM][4];  // (16, 16) A blocks
      uint32_t b_frag[Tile::kMmaN][2];  // (16, 8) B blocks
#pragma unroll
      for (int mi = 0; mi < Tile::kMmaM; ++mi) {
        ldmatrix_x4<!kAKMajor>(a_frag[mi],
                               stage_a + OperandA::fragment_offset(a_lane, warp_m0 + mi * 16, kk));
      }
#pragma unroll
      for (int np = 0; np < Tile::kMmaN / 2; ++np) {
        uint32_t r[4];
        ldmatrix_x4<!kBKMajor>(r, stage_b + OperandB::fragment_offset(b_lane, warp_n0 + np * 16, kk));
        b_frag[2 * np][0] = r[0];
        b_frag[2 * np][1] = r[1];
        b_frag[2 * np + 1][0] = r[2];
        b_frag[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < Tile::kMmaM; ++mi) {
#pragma unroll
        for (int ni = 0; ni < Tile::kMmaN; ++ni) {
          mma_16816<T>(acc[mi][ni], a_frag[mi], b_frag[ni][0], b_frag[ni][1]);
        }
      }
    }
  }

  // The bias of this lane's columns, read once (after the main loop, whose registers it would
  // crowd).
  float bias[Tile::kMmaN][2] = {};  // (WARP_N / 8, 2)
  if constexpr (kBias) {
#pragma unroll
    for (int ni = 0; ni < Tile::kMmaN; ++ni) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        bias[ni][j] = load_bias<T>(p, n0 + sm80_accumulator(warp, lane, 0, ni, j).col);
      }
    }
  }

  // Epilogue straight from the accumulators: each lane owns column pairs (2c, 2c + 1). The bias
  // and the activation are template parameters, so an instance holds its own epilogue only.
  const bool pairs_aligned = p.n % 2 == 0;
#pragma unroll
  for (int mi = 0; mi < Tile::kMmaM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < Tile::kMmaN; ++ni) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const Coord c = sm80_accumulator(warp, lane, mi, ni, 2 * half);
        const int32_t row = m0 + c.row;
        const int32_t col = n0 + c.col;
        if (row >= p.m || col >= p.n) continue;
        const bool has_second = col + 1 < p.n;
        const bool vector = has_second && pairs_aligned;
        float z0 = acc[mi][ni][2 * half], z1 = acc[mi][ni][2 * half + 1];
        if constexpr (kBias) {
          z0 += bias[ni][0];
          z1 += bias[ni][1];
        }
        const int64_t offset = int64_t(row) * p.n + col;
        if (p.preact != nullptr) {
          store_pair<T>(p.preact, offset, z0, z1, has_second, vector, p.out_fp32);
        }
        store_pair<T>(p.out, offset, activate<kAct>(z0), activate<kAct>(z1), has_second, vector,
                      p.out_fp32);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 800
}

template <typename T, bool kAKMajor, bool kBKMajor, bool kBias, Activation kAct>
void launch_sm80_kernel(const GemmParams& p, cudaStream_t stream) {
  using Tile = Sm80Tile;
  constexpr int kSmemBytes = Tile::kStages * (Sm80Operand<kAKMajor, Tile::kBlockM>::kBytes +
                                              Sm80Operand<kBKMajor, Tile::kBlockN>::kBytes);
  auto* kernel = gemm_sm80_kernel<T, kAKMajor, kBKMajor, kBias, kAct>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes);
  const int32_t blocks = ceil_div(p.m, Tile::kBlockM) * ceil_div(p.n, Tile::kBlockN);
  kernel<<<blocks, Tile::kThreads, kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_sm80(const GemmParams& p, cudaStream_t stream) {
  with_kernel_instance(p, [&](auto a_k_major, auto b_k_major, auto has_bias, auto act) {
    launch_sm80_kernel<T, decltype(a_k_major)::value, decltype(b_k_major)::value,
                       decltype(has_bias)::value, decltype(act)::value>(p, stream);
  });
}

}  // namespace fusedamp::gemm

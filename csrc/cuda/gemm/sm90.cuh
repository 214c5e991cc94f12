// The sm_90a GEMM kernel: TMA loads into a kStages-deep ring of 128B-swizzled smem stages guarded by
// mbarriers, one producer warpgroup and two consumer warpgroups running wgmma, either together on
// 128 x 256 tiles or taking turns on 128 x 128 tiles (Sm90Schedule), a persistent grid walking the
// tile schedule, setmaxnreg moving registers to the consumers, and an epilogue that stages 64 x
// 128-byte boxes in swizzled smem and writes them with TMA stores. Included once per input type
// (sm90_*.cu); the kernel body exists only in sm_90a code.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include "cuda/gemm/device.cuh"
#include "cuda/gemm/launch.h"
#include "cuda/gemm/wgmma.cuh"

namespace fusedamp::gemm {

struct Sm90Params {
  GemmParams g;            // the problem; the tensor maps below describe the same memory
  CUtensorMap a_map;       // A: K-major boxes (BLK_K, BLK_M) or MN-major boxes (64 m, BLK_K)
  CUtensorMap b_map;       // B: K-major boxes (BLK_K, BLK_N) or MN-major boxes (64 n, BLK_K)
  CUtensorMap out_map;     // out (16-bit only): boxes of 64 columns x 64 rows
  CUtensorMap preact_map;  // preact like out_map (a copy of out_map when g.preact is nullptr)
};

// One operand's smem tile, BLK_K = 64 elements = one 128-byte swizzle row. K-major: kMn rows of
// 128 bytes, one TMA box. MN-major: kMn / 64 boxes, each BLK_K rows of 64 mn (128 bytes).
template <bool kKMajor, int kMn>
struct Sm90Operand {
  using Tile = Sm90TileCommon;
  static constexpr uint32_t kBytes = kMn * Tile::kBlockK * 2;  // (kMn, BLK_K) 16-bit
  static constexpr int kBoxes = kKMajor ? 1 : kMn / Tile::kBoxMn;
  static constexpr uint32_t kBoxBytes = kBytes / kBoxes;
  static_assert(Tile::kBlockK * 2 == 128, "Sm90Operand: BLK_K must fill one 128-byte row");
  static_assert(kMn % Tile::kBoxMn == 0, "Sm90Operand: MN extent must be whole 64-wide boxes");

  // Descriptor of the (64 or kMn, 16) slice starting at row `mn0` (a multiple of 64) for k step
  // `kk` (16 elements each). K-major: k steps are 32 bytes along the swizzled row, 8-row groups
  // 1024 bytes apart. MN-major: k steps are 16 rows (2 KiB), 8-row k groups 1024 bytes apart and
  // 64-wide MN blocks one box apart.
  static __device__ __forceinline__ uint64_t descriptor(uint32_t tile, int32_t mn0, int32_t kk) {
    if constexpr (kKMajor) {
      return wgmma_descriptor(tile + mn0 * 128 + kk * 32, 16, 1024);
    } else {
      return wgmma_descriptor(tile + (mn0 / Tile::kBoxMn) * kBoxBytes + kk * 16 * 128,
                              kBoxBytes, 1024);
    }
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t x,
                                            int32_t y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int32_t x,
                                             int32_t y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   map),
               "r"(x), "r"(y), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Orders this thread's generic-proxy smem writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads toward barrier `id` without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Writes one 64 x kBlockN slice of a consumer's results, act(acc + bias) in the input type, through
// its 64 x 128-byte staging buffer, one TMA store per 128-byte column chunk. `bias` holds the tile's
// kBlockN bias columns in fp32 (smem, read only with kBias). The bias and the activation are
// template parameters: each kernel instance holds its own epilogue and nothing else. Only 16-bit
// outputs: a second (fp32) variant in the same kernel made ptxas spill.
template <typename T, int kBlockN, bool kBias, Activation kAct>
__device__ __forceinline__ void store_slice(const CUtensorMap* map, const float (&acc)[kBlockN / 2],
                                            const float* bias, uint32_t staging, int32_t thread,
                                            uint32_t barrier_id, int32_t row0, int32_t col0) {
  constexpr int kCols = 128 / sizeof(T);  // output columns per 128-byte staging row
  constexpr int kPairs = kCols / 4;       // accumulator pairs of a thread in one chunk
  static_assert(kBlockN % kCols == 0, "store_slice: BLK_N must be whole chunks");
#pragma unroll
  for (int chunk = 0; chunk < kBlockN / kCols; ++chunk) {
    // The previous TMA store must have finished reading the staging buffer; the first barrier
    // also publishes the tile's bias to the consumer.
    if (thread == 0) bulk_wait_read_all();
    named_barrier_sync(barrier_id, 128);
    // This chunk's bias pairs are read before its st.shared: those are asm with memory clobbers,
    // and a read written after one of them stays after it.
    float2 chunk_bias[kPairs];
    if constexpr (kBias) {
#pragma unroll
      for (int pair = 0; pair < kPairs; ++pair) {
        const Coord e = wgmma_accumulator(thread, chunk * kPairs * 2 + pair * 2);
        chunk_bias[pair] = *reinterpret_cast<const float2*>(bias + e.col);
      }
    }
#pragma unroll
    for (int pair = 0; pair < kPairs; ++pair) {
      const int index = chunk * kPairs * 2 + pair * 2;  // accumulators index, index + 1
      const Coord e = wgmma_accumulator(thread, index);
      float v0 = acc[index], v1 = acc[index + 1];
      if constexpr (kBias) {
        v0 += chunk_bias[pair].x;
        v1 += chunk_bias[pair].y;
      }
      v0 = activate<kAct>(v0);
      v1 = activate<kAct>(v1);
      const int32_t byte = (e.col - chunk * kCols) * int32_t(sizeof(T));
      const uint32_t address = staging + swizzle_128b(e.row * 128 + byte);
      const typename HalfTraits<T>::Pair packed = HalfTraits<T>::pack(v0, v1);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address),
                   "r"(*reinterpret_cast<const uint32_t*>(&packed))
                   : "memory");
    }
    fence_proxy_async_smem();
    named_barrier_sync(barrier_id, 128);
    if (thread == 0) {
      tma_store_2d(map, staging, col0 + chunk * kCols, row0);
      bulk_commit();
    }
  }
}
#endif

// One instance per schedule, input type, operand layouts and epilogue (bias or not, activation).
template <Sm90Schedule kSchedule, typename T, bool kAKMajor, bool kBKMajor, bool kBias,
          Activation kAct>
__global__ void __launch_bounds__(Sm90TileCommon::kThreads, 1)
    gemm_sm90_kernel(const __grid_constant__ Sm90Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = Sm90Tile<kSchedule>;
  using OperandA = Sm90Operand<kAKMajor, Tile::kBlockM>;
  using OperandB = Sm90Operand<kBKMajor, Tile::kBlockN>;
  constexpr uint32_t kStageBytes = OperandA::kBytes + OperandB::kBytes;
  constexpr uint32_t kStagingBytes = Tile::kStoreRows * 128;
  static_assert(kStageBytes % 1024 == 0, "gemm_sm90_kernel: stages must keep 1024-byte alignment");
  static_assert(Tile::kConsumerRows % 64 == 0, "gemm_sm90_kernel: whole wgmma m64 slices");

  __shared__ __align__(8) uint64_t full[Tile::kStages];   // TMA -> consumers: stage s loaded
  __shared__ __align__(8) uint64_t empty[Tile::kStages];  // consumers -> TMA: stage s free
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Swizzle patterns repeat every 1024 bytes and the descriptors assume aligned atoms.
  const uint32_t smem = (smem_address(smem_raw) + 1023) & ~1023u;  // kStages x [(A) (B)], staging

  const int32_t tiles_m = ceil_div(p.g.m, Tile::kBlockM);
  const int32_t tiles_n = ceil_div(p.g.n, Tile::kBlockN);
  const int32_t tiles = tiles_m * tiles_n;
  const int32_t k_tiles = ceil_div(p.g.k, Tile::kBlockK);
  const int32_t warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Tile::kStages; ++s) {
      mbar_init(smem_address(&full[s]), 1);
      mbar_init(smem_address(&empty[s]), Tile::kStageReaders);
    }
    // Makes the initialized barriers visible to the async proxy (TMA) as well.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Producer: one thread issues every TMA load, tile by tile in walk order; the warpgroup gives
    // its registers away.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      uint32_t iteration = 0;
      for (int32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const TileCoord c = tile_of(tile, tiles_m, tiles_n, 8);
        for (int32_t kt = 0; kt < k_tiles; ++kt, ++iteration) {
          const uint32_t s = iteration % Tile::kStages;
          const uint32_t parity = (iteration / Tile::kStages) & 1;
          // A fresh barrier counts as having completed the phase before phase 0.
          mbar_wait(smem_address(&empty[s]), parity ^ 1);
          const uint32_t bar = smem_address(&full[s]);
          mbar_expect_tx(bar, kStageBytes);
          const uint32_t stage = smem + s * kStageBytes;
          const int32_t k0 = kt * Tile::kBlockK;
          if constexpr (kAKMajor) {
            tma_load_2d(stage, &p.a_map, k0, c.m * Tile::kBlockM, bar);
          } else {
#pragma unroll
            for (int box = 0; box < OperandA::kBoxes; ++box) {
              tma_load_2d(stage + box * OperandA::kBoxBytes, &p.a_map,
                          c.m * Tile::kBlockM + box * Tile::kBoxMn, k0, bar);
            }
          }
          const uint32_t stage_b = stage + OperandA::kBytes;
          if constexpr (kBKMajor) {
            tma_load_2d(stage_b, &p.b_map, k0, c.n * Tile::kBlockN, bar);
          } else {
#pragma unroll
            for (int box = 0; box < OperandB::kBoxes; ++box) {
              tma_load_2d(stage_b + box * OperandB::kBoxBytes, &p.b_map,
                          c.n * Tile::kBlockN + box * Tile::kBoxMn, k0, bar);
            }
          }
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int32_t consumer = warpgroup - 1;
  const int32_t thread = threadIdx.x % 128;
  const uint32_t staging = smem + Tile::kStages * kStageBytes + consumer * kStagingBytes;
  const uint32_t store_barrier = 1 + consumer;  // 0 is __syncthreads
  // Ping-pong turns: barrier 3 + c opens consumer c's next main loop (the other consumer arrives
  // when its own main loop is done).
  const uint32_t my_turn = 3 + consumer, their_turn = 3 + (1 - consumer);
  // The consumer's first smem row of A in a stage: the two split a cooperative tile's rows.
  const int32_t a_row = Tile::kCooperative ? consumer * Tile::kConsumerRows : 0;
  float* bias = nullptr;  // (BLK_N) this consumer's copy of the tile's bias, fp32
  if constexpr (kBias) {
    __shared__ __align__(16) float bias_tiles[Tile::kConsumers][Tile::kBlockN];
    bias = bias_tiles[consumer];
  }
  float acc[Tile::kSlices][Tile::kBlockN / 2];  // this thread's share of its (rows, BLK_N) tile
  const Sm90Walk walk = sm90_consumer_walk(kSchedule, consumer);
  for (int32_t j = walk.first; blockIdx.x + j * gridDim.x < tiles; j += walk.step) {
    const TileCoord c = tile_of(blockIdx.x + j * gridDim.x, tiles_m, tiles_n, 8);
    const int32_t row0 = c.m * Tile::kBlockM + a_row;
    const int32_t col0 = c.n * Tile::kBlockN;
    // The tile's bias, once per tile: read from global memory before the main loop, which hides
    // the latency, and kept in smem for the epilogue.
    float tile_bias[Tile::kBlockN / 128];  // columns col0 + thread + 128 i
    if constexpr (kBias) {
#pragma unroll
      for (int i = 0; i < Tile::kBlockN / 128; ++i) {
        tile_bias[i] = load_bias<T>(p.g, col0 + thread + 128 * i);
      }
    }
    if constexpr (!Tile::kCooperative) {
      if (j > 0) named_barrier_sync(my_turn, 256);
    }
    uint32_t iteration = uint32_t(j) * uint32_t(k_tiles);
    for (int32_t kt = 0; kt < k_tiles; ++kt, ++iteration) {
      const uint32_t s = iteration % Tile::kStages;
      mbar_wait(smem_address(&full[s]), (iteration / Tile::kStages) & 1);
      const uint32_t stage = smem + s * kStageBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Tile::kBlockK / 16; ++kk) {
#pragma unroll
        for (int slice = 0; slice < Tile::kSlices; ++slice) {
          wgmma_m64nNk16<T, Tile::kBlockN, !kAKMajor, !kBKMajor>(
              acc[slice], OperandA::descriptor(stage, a_row + slice * 64, kk),
              OperandB::descriptor(stage + OperandA::kBytes, 0, kk), kt > 0 || kk > 0);
        }
      }
      wgmma_commit();
      // One k tile of wgmmas stays in flight while the next is issued; the stage of the one
      // before it is free once that has finished.
      if (kt > 0) {
        wgmma_wait<1>();
        if (thread == 0) mbar_arrive(smem_address(&empty[(iteration - 1) % Tile::kStages]));
      }
    }
    wgmma_wait<0>();
    if (thread == 0) mbar_arrive(smem_address(&empty[(iteration - 1) % Tile::kStages]));
    if constexpr (!Tile::kCooperative) {
      // The other consumer's next tile may start while this one stores.
      if (blockIdx.x + (j + 1) * gridDim.x < tiles) named_barrier_arrive(their_turn, 256);
    }

    if constexpr (kBias) {
      // Every thread of the consumer has read the previous tile's bias: the last barrier of its
      // store_slice came after the reads. The first barrier of the next one publishes these.
#pragma unroll
      for (int i = 0; i < Tile::kBlockN / 128; ++i) bias[thread + 128 * i] = tile_bias[i];
    }
#pragma unroll
    for (int slice = 0; slice < Tile::kSlices; ++slice) {
      const int32_t slice_row = row0 + slice * 64;
      if (p.g.preact != nullptr) {
        store_slice<T, Tile::kBlockN, kBias, Activation::kNone>(
            &p.preact_map, acc[slice], bias, staging, thread, store_barrier, slice_row, col0);
      }
      store_slice<T, Tile::kBlockN, kBias, kAct>(&p.out_map, acc[slice], bias, staging, thread,
                                                 store_barrier, slice_row, col0);
    }
  }
  if (thread == 0) bulk_wait_all();
#endif
}

// A 2-D TMA descriptor over a row-major (outer, inner) matrix of `element_bytes`-byte elements
// with leading dimension `ld` elements, read or written in 128B-swizzled boxes.
inline CUtensorMap encode_tensor_map(const void* base, CUtensorMapDataType dtype,
                                     uint32_t element_bytes, uint64_t inner, uint64_t outer,
                                     uint64_t ld, uint32_t box_inner, uint32_t box_outer) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &status));
    TORCH_CHECK(fn != nullptr && status == cudaDriverEntryPointSuccess,
                "fusedamp.gemm: the CUDA driver has no cuTensorMapEncodeTiled; update the driver "
                "or use the reference gemm backend");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {ld * element_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode(&map, dtype, 2, const_cast<void*>(base), dims, strides, box,
                                 element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "fusedamp.gemm: cuTensorMapEncodeTiled failed (error ",
              int(result), ") for a ", outer, " x ", inner, " operand with leading dimension ", ld);
  return map;
}

// encode_tensor_map, remembered: the descriptor is a pure function of these arguments (the base
// address included), and a training step calls the gemm with the same few (address, shape) pairs
// again and again (weights stay put; the caching allocator hands activations the same blocks).
inline CUtensorMap make_tensor_map(const void* base, CUtensorMapDataType dtype,
                                   uint32_t element_bytes, uint64_t inner, uint64_t outer,
                                   uint64_t ld, uint32_t box_inner, uint32_t box_outer) {
  static Memo<8, CUtensorMap> maps(1024);
  return maps.get({uint64_t(reinterpret_cast<uintptr_t>(base)), uint64_t(dtype), element_bytes,
                   inner, outer, ld, box_inner, box_outer},
                  [&] {
                    return encode_tensor_map(base, dtype, element_bytes, inner, outer, ld,
                                             box_inner, box_outer);
                  });
}

template <Sm90Schedule kSchedule, typename T, bool kAKMajor, bool kBKMajor, bool kBias,
          Activation kAct>
void launch_sm90_kernel(const GemmParams& g, int sm_count, cudaStream_t stream) {
  using Tile = Sm90Tile<kSchedule>;
  constexpr CUtensorMapDataType kType = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  Sm90Params p;
  p.g = g;
  p.a_map = kAKMajor
                ? make_tensor_map(g.a, kType, 2, g.k, g.m, g.lda, Tile::kBlockK, Tile::kBlockM)
                : make_tensor_map(g.a, kType, 2, g.m, g.k, g.lda, Tile::kBoxMn, Tile::kBlockK);
  p.b_map = kBKMajor
                ? make_tensor_map(g.b, kType, 2, g.k, g.n, g.ldb, Tile::kBlockK, Tile::kBlockN)
                : make_tensor_map(g.b, kType, 2, g.n, g.k, g.ldb, Tile::kBoxMn, Tile::kBlockK);
  TORCH_CHECK(!g.out_fp32, "fusedamp.gemm: the sm90 kernel writes 16-bit outputs only");
  p.out_map = make_tensor_map(g.out, kType, 2, g.n, g.m, g.n, 64, Tile::kStoreRows);
  p.preact_map = g.preact == nullptr
                     ? p.out_map
                     : make_tensor_map(g.preact, kType, 2, g.n, g.m, g.n, 64, Tile::kStoreRows);

  auto* kernel = gemm_sm90_kernel<kSchedule, T, kAKMajor, kBKMajor, kBias, kAct>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), Tile::kSmemBytes);
  const int32_t tiles = ceil_div(g.m, Tile::kBlockM) * ceil_div(g.n, Tile::kBlockN);
  const int32_t grid = tiles < sm_count ? tiles : sm_count;  // persistent: one CTA per SM
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_sm90(const GemmParams& p, Sm90Schedule schedule, int sm_count, cudaStream_t stream) {
  with_kernel_instance(p, [&](auto a_k_major, auto b_k_major, auto has_bias, auto act) {
    constexpr bool kA = decltype(a_k_major)::value, kB = decltype(b_k_major)::value;
    constexpr bool kBias = decltype(has_bias)::value;
    constexpr Activation kAct = decltype(act)::value;
    if (schedule == Sm90Schedule::kPingpong) {
      launch_sm90_kernel<Sm90Schedule::kPingpong, T, kA, kB, kBias, kAct>(p, sm_count, stream);
    } else {
      launch_sm90_kernel<Sm90Schedule::kCooperative, T, kA, kB, kBias, kAct>(p, sm_count, stream);
    }
  });
}

}  // namespace fusedamp::gemm

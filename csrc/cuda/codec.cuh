// The CUDA side of [note: block staging] (cpu/blocks.h), the twin of cpu/codec.h: a thread's
// elements of an optimizer state loaded as fp32 through the call's codec (math/codec.h) and stored
// back, the scale and form of each 8-bit block reduced over the threads that hold it.
#pragma once

#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"

namespace fusedamp::cuda {

template <StateCodec C>
using codec_storage_t = std::conditional_t<C == StateCodec::kFloat32, float,
                                           std::conditional_t<C == StateCodec::kBFloat16, uint16_t, uint8_t>>;

// [note: coded iterations] A coded kernel walks its chunk in iterations that every thread of the
// block takes part in (also past the chunk's end, with zeros), because an 8-bit block's scale is a
// reduction over the values of the block. Its layout (CodedLayout, [note: coded layouts]) gives
// each thread kRuns runs of kCodedRun values (16 bytes of an fp32 list), and the threads of a codec
// block side by side: two warps with one run each (the scale reduced through shared memory,
// between two barriers that hold every warp of the CUDA block) or one warp with two runs (reduced
// within the warp). The kernel takes a thread's runs one after the other through load, math and
// store of the param side and keeps only the states' fp32 values of the earlier runs until the
// states are stored: both runs at once took up to twice the registers (ptxas), a quarter of the
// blocks an SM holds. The launcher's coded_runs setting picks the layout of the 8-bit states'
// kernels (with_coded_layout); the others take one run.
struct CodedRun {
  int first;    // the run's first element in the chunk
  bool vector;  // the run lies in the chunk and the chunk is aligned (ElementGroup's vector accesses)
};

template <int kRuns>
struct CodedLayout {
  static constexpr int kValues = kCodedRun * kRuns;                      // a thread's, per iteration
  static constexpr int kCodecBlockThreads = int(kCodecBlock) / kValues;  // the threads of a codec block
  static constexpr int kCodecBlockWarps = kCodecBlockThreads / kWarpThreads;
  static constexpr int kElements = kBlockThreads * kValues;              // an iteration's
  static_assert(kCodecBlockWarps >= 1 && kCodecBlockThreads % kWarpThreads == 0,
                "a codec block must be whole warps");
  static_assert(kElements % int(kCodecBlock) == 0, "an iteration must be whole codec blocks");
  static_assert(kMinChunkSize % kElements == 0, "a chunk must be whole iterations");

  // This thread's run r in the iteration from element `base` of a chunk of `count` elements.
  static __device__ __forceinline__ CodedRun run(int base, int r, int count, bool aligned) {
    const int first = base + coded_element_offset(r * kCodedRun, int32_t(threadIdx.x), kRuns, int32_t(kCodecBlock));
    return {first, aligned && first + kCodedRun <= count};
  }
};

// Calls body(base) with the first element of each iteration of a chunk of `count` elements
// ([note: coded iterations]); every thread takes part in each, also where its elements lie past
// the chunk's end.
template <int kRuns, typename Body>
__device__ __forceinline__ void for_each_coded_group(int count, Body&& body) {
  for (int base = 0; base < count; base += CodedLayout<kRuns>::kElements) body(base);
}

// Calls launch(std::integral_constant<int, runs>) with the coded kernels' current layout
// (launch_settings, [note: coded layouts]).
template <typename Launch>
void with_coded_layout(Launch&& launch) {
  if (launch_settings().coded_runs.load(std::memory_order_relaxed) == 2) {
    launch(std::integral_constant<int, 2>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

// The scales of an 8-bit state list from the chunk's first block (null stays null: no scales).
template <typename Meta>
__device__ __forceinline__ uint16_t* chunk_scales(const Meta& meta, int list, const ChunkLocation& chunk) {
  uint16_t* base = slot_pointer<uint16_t>(meta, list, chunk.slot);
  return base == nullptr ? nullptr : base + chunk.begin / kCodecBlock;
}

// The largest of `max_bits` and the sum of `exponent_sum` (kSum) over the threads of this thread's
// codec block (CodedLayout<kRuns>), in both arguments. Every thread of the CUDA block calls it,
// the same number of times.
template <int kRuns, bool kSum>
__device__ __forceinline__ void codec_block_reduce(uint32_t& max_bits, uint32_t& exponent_sum) {
#if __CUDA_ARCH__ >= 800
  max_bits = __reduce_max_sync(0xffffffffu, max_bits);
  if constexpr (kSum) exponent_sum = __reduce_add_sync(0xffffffffu, exponent_sum);
#else
  // Turing and older have no redux.sync: a butterfly of shuffles leaves the result in every lane.
#pragma unroll
  for (int lanes = kWarpThreads / 2; lanes >= 1; lanes /= 2) {
    max_bits = max(max_bits, __shfl_xor_sync(0xffffffffu, max_bits, lanes));
    if constexpr (kSum) exponent_sum += __shfl_xor_sync(0xffffffffu, exponent_sum, lanes);
  }
#endif
  constexpr int kWarps = CodedLayout<kRuns>::kCodecBlockWarps;
  if constexpr (kWarps > 1) {
    __shared__ uint32_t warp_max[kBlockThreads / kWarpThreads];
    __shared__ uint32_t warp_sum[kSum ? kBlockThreads / kWarpThreads : 1];
    const int warp = int(threadIdx.x) / kWarpThreads;
    if (threadIdx.x % kWarpThreads == 0) {
      warp_max[warp] = max_bits;
      if constexpr (kSum) warp_sum[warp] = exponent_sum;
    }
    __syncthreads();
    const int first_warp = warp - warp % kWarps;
    max_bits = 0;
    if constexpr (kSum) exponent_sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      max_bits = max(max_bits, warp_max[first_warp + w]);
      if constexpr (kSum) exponent_sum += warp_sum[first_warp + w];
    }
    __syncthreads();  // the next call overwrites warp_max and warp_sum
  }
}

// A thread's elements of one optimizer state in an iteration of layout CodedLayout<kRuns> ([note:
// coded iterations]) in registers as fp32 (`values`, run r's from r * kCodedRun), loaded from codec
// C and stored back a run at a time (8-bit codes: the whole block with the thread's last run), its
// stochastic roundings taking share S of each element's draw ([note: shared state draws]).
template <StateCodec C, bool kSigned, int kRuns, DrawShare S = DrawShare::kWhole>
struct StateGroup {
  using Layout = CodedLayout<kRuns>;
  float values[Layout::kValues];
  ElementGroup<codec_storage_t<C>, kCodedRun> runs[kRuns];
  uint16_t scale = 0;  // 8-bit: the block's scale as loaded ([note: steady scales])

  // The values of run r, for the op's element math.
  __device__ __forceinline__ float* run_values(int r) { return values + r * kCodedRun; }

  // The thread's run r of the iteration from element `base`. chunk: the state at the chunk's first
  // element; scales: the chunk's first scale (8-bit only), read with run 0 (a thread's runs share
  // a block).
  __device__ __forceinline__ void load(const codec_storage_t<C>* chunk, const uint16_t* scales, int base, int r,
                                       int count, bool aligned) {
    const CodedRun run = Layout::run(base, r, count, aligned);
    runs[r].load(chunk, run.first, count, run.vector);
    if (C == StateCodec::kInt8 && r == 0) {
      scale = run.first < count ? scales[run.first / int(kCodecBlock)] : uint16_t(0);
    }
#pragma unroll
    for (int j = 0; j < kCodedRun; ++j) {
      if constexpr (C == StateCodec::kFloat32) {
        run_values(r)[j] = runs[r].values[j];
      } else if constexpr (C == StateCodec::kBFloat16) {
        run_values(r)[j] = bf16_to_float(runs[r].values[j]);
      } else {
        run_values(r)[j] = decode_code<kSigned>(runs[r].values[j], scale);
      }
    }
  }

  // Stores what the op's math on run r completes: the run (fp32, bf16), or at the thread's last run
  // the block's scale, form and codes (8-bit), so every thread of the CUDA block calls it (those
  // are reductions over the codec block's threads). bf16 and 8-bit states are rounded
  // stochastically ([note: unbiased state rounding]) with the dithered draws of their elements
  // under `key` and this step's `rotation` ([note: dithered draws]); `chunk_begin`: the tensor's
  // element at the chunk's first.
  __device__ __forceinline__ void store(codec_storage_t<C>* chunk, uint16_t* scales, int base, int r, int count,
                                        bool aligned, uint32_t key, int64_t chunk_begin, uint32_t rotation) {
    if constexpr (C != StateCodec::kInt8) {
      store_run(chunk, base, r, count, aligned, key, chunk_begin, rotation, BlockEncoding{});
    } else if (r == kRuns - 1) {
      uint32_t max_bits = 0, exponent_sum = 0;
#pragma unroll
      for (int q = 0; q < kRuns; ++q) {
        const int run_first = Layout::run(base, q, count, aligned).first;
#pragma unroll
        for (int j = 0; j < kCodedRun; ++j) {
          // Past the chunk's end the values are computed on zeros: they must not count.
          if (run_first + j < count) {
            max_bits = max(max_bits, finite_magnitude_bits(run_values(q)[j]));
            if constexpr (kSigned) exponent_sum += magnitude_exponent(float_bits(run_values(q)[j]) & 0x7fffffffu);
          }
        }
      }
      codec_block_reduce<kRuns, kSigned>(max_bits, exponent_sum);
      const int first = Layout::run(base, 0, count, aligned).first;
      const int block_first = first - first % int(kCodecBlock);
      const uint32_t n = uint32_t(min(int(kCodecBlock), count - block_first));
      const bool wide = count > block_first && block_is_wide<kSigned>(max_bits, exponent_sum, n, scale_is_wide(scale));
      scale = block_scale_bits<kSigned>(max_bits, wide, scale);
      if (first % int(kCodecBlock) == 0 && first < count) scales[first / int(kCodecBlock)] = scale;
      const BlockEncoding encoding = block_encoding(scale);
#pragma unroll
      for (int q = 0; q < kRuns; ++q) store_run(chunk, base, q, count, aligned, key, chunk_begin, rotation, encoding);
    }
  }

 private:
  // Run r rounded to codec C (8-bit: with the block's `encoding`) and stored. A run starts at a
  // multiple of kCodedRun, so it lies in one dither group ([note: dither phases]).
  __device__ __forceinline__ void store_run(codec_storage_t<C>* chunk, int base, int r, int count, bool aligned,
                                            uint32_t key, int64_t chunk_begin, uint32_t rotation,
                                            BlockEncoding encoding) {
    static_assert(kDitherGroup % kCodedRun == 0, "a run lies in one dither group");
    const CodedRun run = Layout::run(base, r, count, aligned);
    const int64_t element = chunk_begin + run.first;
    const uint32_t group_bits = dither_group_bits(key, element) + rotation;
    const uint32_t first_place = uint32_t(element % kDitherGroup);
#pragma unroll
    for (int j = 0; j < kCodedRun; ++j) {
      const uint32_t draw = group_bits + dither_lane_offset(first_place + j);
      if constexpr (C == StateCodec::kFloat32) {
        runs[r].values[j] = run_values(r)[j];
      } else if constexpr (C == StateCodec::kBFloat16) {
        runs[r].values[j] = float_to_bf16_state(run_values(r)[j], bf16_state_random<S>(draw));
      } else {
        runs[r].values[j] = encode_code<kSigned>(run_values(r)[j], encoding, stochastic_code_unit<S>(draw));
      }
    }
    runs[r].store(chunk, run.first, count, run.vector);
  }
};

// with_coded_kernel's types: launch(p, g, m, c, stochastic).
template <typename Call, typename Launch>
void with_coded_types(const Call& call, Launch&& launch) {
  with_float_dtype(call.param_dtype, [&](auto p) {
    constexpr DType P = decltype(p)::value;
    with_float_dtype(call.grad_dtype, [&](auto g) {
      if constexpr (!kSteppedGradType<P, decltype(g)::value>) {
        fail_no_kernel("grad element type", int32_t(decltype(g)::value), int32_t(P));
      } else {
        if (call.rounding.enabled) {
          // The op's checks (check_rounding_ids) admit nothing else: a call that gets here otherwise
          // is a bug, never a silent no-op.
          TORCH_CHECK(P != DType::kFloat32 && call.master_kind == MasterKind::kNone, "fusedamp internal error: ",
                      Call::kOp, ": stochastic params need half params without masters");
          if constexpr (P != DType::kFloat32) {
            with_state_codec(call.state_codec,
                             [&](auto c) { launch(p, g, MasterTag<MasterKind::kNone>{}, c, std::true_type{}); });
          }
          return;
        }
        with_master_kind<P>(call.master_kind, [&](auto m) {
          if (call.state_codec == StateCodec::kBFloat16) {
            launch(p, g, m, std::integral_constant<StateCodec, StateCodec::kBFloat16>{}, std::false_type{});
          } else {
            launch(p, g, m, std::integral_constant<StateCodec, StateCodec::kInt8>{}, std::false_type{});
          }
        });
      }
    });
  });
}

// The coded kernels an optimizer call takes (host side): stochastically rounded half params (no
// master) under any codec, or each master kind under bf16 or int8 codes; 8-bit states in the
// current layout (with_coded_layout), the others in one run (their stores reduce nothing). Calls
// launch(p, g, m, c, stochastic, runs) with their tags; each op's coded launcher is that one lambda.
template <typename Call, typename Launch>
void with_coded_kernel(const Call& call, Launch&& launch) {
  with_coded_types(call, [&](auto p, auto g, auto m, auto c, auto stochastic) {
    if constexpr (decltype(c)::value == StateCodec::kInt8) {
      with_coded_layout([&](auto runs) { launch(p, g, m, c, stochastic, runs); });
    } else {
      launch(p, g, m, c, stochastic, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace fusedamp::cuda

// The CUDA side of [note: block staging] (cpu/blocks.h), the twin of cpu/codec.h: a thread's E
// consecutive elements of an optimizer state loaded as fp32 through the call's codec (math/codec.h)
// and stored back, the scale and form of each 8-bit block reduced over the threads that share it.
#pragma once

#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"

namespace fusedamp::cuda {

template <StateCodec C>
using codec_storage_t = std::conditional_t<C == StateCodec::kFloat32, float,
                                           std::conditional_t<C == StateCodec::kBFloat16, uint16_t, uint8_t>>;

// [note: coded iterations] A coded kernel walks its chunk in iterations of kBlockThreads * E
// elements that every thread of the block takes part in (also past the chunk's end, with zeros),
// because an 8-bit block's scale is a reduction over the kCodecBlock / E threads that own it:
// thread t owns elements [E t, E t + E) of the iteration, so a codec block is a run of whole warps.
template <int E>
struct CodedIterations {
  static constexpr int kElements = kBlockThreads * E;
  static constexpr int kWarpsPerCodecBlock = int(kCodecBlock) / E / 32;
  static_assert(kWarpsPerCodecBlock >= 1 && int(kCodecBlock) % (E * 32) == 0,
                "a codec block must be whole warps");
  static_assert(kElements % int(kCodecBlock) == 0, "an iteration must be whole codec blocks");
  static_assert(kMinChunkSize % kElements == 0, "a chunk must be whole iterations");
};

// Calls body(first, vector) for this thread's group of E elements in each iteration of a chunk of
// `count` elements, past the chunk's end too ([note: coded iterations]); `vector`: the group is
// complete and the chunk aligned (ElementGroup).
template <int E, typename Body>
__device__ __forceinline__ void for_each_coded_group(int count, bool aligned, Body&& body) {
  for (int base = 0; base < count; base += CodedIterations<E>::kElements) {
    const int first = base + int(threadIdx.x) * E;
    body(first, aligned && first + E <= count);
  }
}

// The scales of an 8-bit state list from the chunk's first block (null stays null: no scales).
template <typename Meta>
__device__ __forceinline__ uint16_t* chunk_scales(const Meta& meta, int list, const ChunkLocation& chunk) {
  uint16_t* base = slot_pointer<uint16_t>(meta, list, chunk.slot);
  return base == nullptr ? nullptr : base + chunk.begin / kCodecBlock;
}

// The largest of `max_bits` and the sum of `exponent_sum` (kSum) over the threads of this thread's
// codec block, in both arguments. Every thread of the block calls it, the same number of times.
template <int E, bool kSum>
__device__ __forceinline__ void codec_block_reduce(uint32_t& max_bits, uint32_t& exponent_sum) {
  constexpr int kWarps = CodedIterations<E>::kWarpsPerCodecBlock;
  __shared__ uint32_t warp_max[kBlockThreads / 32];
  __shared__ uint32_t warp_sum[kSum ? kBlockThreads / 32 : 1];
#if __CUDA_ARCH__ >= 800
  max_bits = __reduce_max_sync(0xffffffffu, max_bits);
  if constexpr (kSum) exponent_sum = __reduce_add_sync(0xffffffffu, exponent_sum);
#else
  // Turing and older have no redux.sync: a butterfly of shuffles leaves the result in every lane.
#pragma unroll
  for (int lanes = 16; lanes >= 1; lanes /= 2) {
    max_bits = max(max_bits, __shfl_xor_sync(0xffffffffu, max_bits, lanes));
    if constexpr (kSum) exponent_sum += __shfl_xor_sync(0xffffffffu, exponent_sum, lanes);
  }
#endif
  const int warp = int(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) {
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

// E elements of one state in registers as fp32 (`values`), loaded from and stored to codec C, its
// stochastic roundings taking share S of each element's draw ([note: shared state draws]).
template <StateCodec C, bool kSigned, int E, DrawShare S = DrawShare::kWhole>
struct StateGroup {
  float values[E];
  ElementGroup<codec_storage_t<C>, E> stored;
  uint16_t scale = 0;  // 8-bit: the block's scale as loaded ([note: steady scales])

  // chunk: the state at the chunk's first element; scales: the chunk's first scale (8-bit only).
  __device__ __forceinline__ void load(const codec_storage_t<C>* chunk, const uint16_t* scales, int first,
                                       int count, bool vector) {
    stored.load(chunk, first, count, vector);
    scale = C == StateCodec::kInt8 && first < count ? scales[first / int(kCodecBlock)] : uint16_t(0);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if constexpr (C == StateCodec::kFloat32) {
        values[j] = stored.values[j];
      } else if constexpr (C == StateCodec::kBFloat16) {
        values[j] = bf16_to_float(stored.values[j]);
      } else {
        values[j] = decode_code<kSigned>(stored.values[j], scale);
      }
    }
  }

  // Every thread of the block calls it (an 8-bit block's scale and form are block-wide
  // reductions). bf16 and 8-bit states are rounded stochastically ([note: unbiased state
  // rounding]) with the dithered draws of elements [element, element + E) under `key` and this
  // step's `rotation` ([note: dithered draws]): a multiple of E, so one group's ([note: dither
  // phases]).
  __device__ __forceinline__ void store(codec_storage_t<C>* chunk, uint16_t* scales, int first, int count,
                                        bool vector, uint32_t key, int64_t element, uint32_t rotation) {
    static_assert(kDitherGroup % E == 0, "a thread's elements lie in one dither group");
    const uint32_t group_bits = dither_group_bits(key, element) + rotation;
    const uint32_t first_place = uint32_t(element % kDitherGroup);
    if constexpr (C == StateCodec::kInt8) {
      uint32_t max_bits = 0, exponent_sum = 0;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        // Past the chunk's end the values are computed on zeros: they must not count.
        if (first + j < count) {
          max_bits = max(max_bits, finite_magnitude_bits(values[j]));
          if constexpr (kSigned) exponent_sum += magnitude_exponent(float_bits(values[j]) & 0x7fffffffu);
        }
      }
      codec_block_reduce<E, kSigned>(max_bits, exponent_sum);
      const int block_first = first - first % int(kCodecBlock);
      const uint32_t n = uint32_t(min(int(kCodecBlock), count - block_first));
      const bool wide = count > block_first && block_is_wide<kSigned>(max_bits, exponent_sum, n, scale_is_wide(scale));
      scale = block_scale_bits<kSigned>(max_bits, wide, scale);
      const BlockEncoding encoding = block_encoding(scale);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const uint32_t unit = stochastic_code_unit<S>(group_bits + dither_lane_offset(first_place + j));
        stored.values[j] = encode_code<kSigned>(values[j], encoding, unit);
      }
      if (first % int(kCodecBlock) == 0 && first < count) scales[first / int(kCodecBlock)] = scale;
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if constexpr (C == StateCodec::kFloat32) {
          stored.values[j] = values[j];
        } else {
          stored.values[j] =
              float_to_bf16_state(values[j], bf16_state_random<S>(group_bits + dither_lane_offset(first_place + j)));
        }
      }
    }
    stored.store(chunk, first, count, vector);
  }
};

// The coded kernels an optimizer call takes (host side): stochastically rounded half params (no
// master) under any codec, or each master kind under bf16 or int8 codes. Calls
// launch(p, g, m, c, stochastic) with their tags; each op's coded launcher is that one lambda.
template <typename Call, typename Launch>
void with_coded_kernel(const Call& call, Launch&& launch) {
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

}  // namespace fusedamp::cuda

// Half staging for the CPU kernel builds ([note: half staging]): fp16/bf16 values (and bf16
// params with their remainders) converted to fp32 buffers and back with vector instructions.
// Included by csrc/cpu/kernels/*.cpp only, after their ISA preamble.
#pragma once

#include "fusedamp/dispatch.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/master.h"
#include "fusedamp/math/stochastic.h"

// FUSEDAMP_F16C_LANES (8 or 16, set by the AVX2 / AVX-512 builds on x86-64): convert fp16 with
// the hardware instructions instead of the bit-level code of math/dtypes.h.
#ifndef FUSEDAMP_F16C_LANES
#define FUSEDAMP_F16C_LANES 0
#endif

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// [note: half staging] Converting fp32 to fp16 or bf16 inside the fused loops vectorizes poorly
// (g++ does not use F16C for fp16, and packs the bf16 results with slow lane permutes, at 2x the
// cost of torch's conversion on AVX2). So on x86 builds with vector conversions the kernels
// convert half data one vector at a time (for_each_stage_group) into fp32 buffers (fp16 with the
// F16C/AVX-512 instructions, bf16 with the integer rounding of dtypes.h's float_to_bf16 written
// in vector intrinsics: both round to nearest even with the same NaN rule, so the results are
// identical), run the same per-element math on the buffers as fp32, and convert back. A bf16
// param with a remainder master goes the same way, joined with its remainder into the fp32
// master and split again (master.h's integer join and split, in vector intrinsics). Every
// helper here, and the kernels' element loops, are always_inline: a call per group (which g++
// makes once a file's inlining budget runs out) cost a third of the bf16 AdamW step.
constexpr bool kStageHalf = FUSEDAMP_F16C_LANES > 0;
// 16 values a group on both builds: AVX2 narrows two vectors of bf16 with one pack.
constexpr int64_t kStageLanes = kStageHalf ? 16 : 1;

// step(first, n) for the groups of kGroup values in [begin, end), the last one partial. In the
// full groups n is a compile-time constant, so each group's conversions and math compile to
// straight vector code whose values stay in registers.
template <int64_t kGroup = kStageLanes, typename Step>
[[gnu::always_inline]] inline void for_each_stage_group(int64_t begin, int64_t end, Step&& step) {
  int64_t first = begin;
  for (; first + kGroup <= end; first += kGroup) {
    step(first, std::integral_constant<int64_t, kGroup>{});
  }
  if (first < end) step(first, end - first);
}

[[gnu::always_inline]] inline void fp16_tile_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  for (; i + 16 <= n; i += 16) {
    // The maskz forms: the plain ones trip a -Wmaybe-uninitialized false positive in gcc 12.
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(__mmask16(0xffff), halves));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = fp16_to_float(src[i]);
}

[[gnu::always_inline]] inline void float_tile_to_fp16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_maskz_cvtps_ph(__mmask16(0xffff), _mm512_loadu_ps(src + i),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_fp16(src[i]);
}

// dtypes.h's bf16_to_float (the bits shifted up by 16), a vector at a time: element-wise stores
// would stall the vector loads that read the tile right after (no store-to-load forwarding).
[[gnu::always_inline]] inline void bf16_tile_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  for (; i + 16 <= n; i += 16) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __mmask16 all = 0xffff;  // the maskz forms: see fp16_tile_to_float
    _mm512_storeu_si512(dst + i, _mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, halves), 16));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

#if FUSEDAMP_F16C_LANES == 8
// dtypes.h's float_to_bf16 on 8 lanes, each bf16 in the low half of its 32-bit lane.
[[gnu::always_inline]] inline __m256i bf16_bits_in_lanes(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}
#endif

// dtypes.h's float_to_bf16, lane by lane: round to nearest even on the bit pattern, NaN to
// (bits >> 16) | 0x40.
[[gnu::always_inline]] inline void float_tile_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  const __m512i one = _mm512_set1_epi32(1), half_ulp = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  const __mmask16 all = 0xffff;  // the maskz forms: see fp16_tile_to_float
  for (; i + 16 <= n; i += 16) {
    const __m512 value = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i high = _mm512_maskz_srli_epi32(all, bits, 16);
    const __m512i bias = _mm512_add_epi32(half_ulp, _mm512_and_si512(high, one));
    const __m512i rounded = _mm512_maskz_srli_epi32(all, _mm512_add_epi32(bits, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    const __m512i result = _mm512_mask_or_epi32(rounded, nan, high, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_maskz_cvtepi32_epi16(all, result));
  }
#elif FUSEDAMP_F16C_LANES == 8
  // Two vectors at a time: one pack and one lane gather narrow both.
  for (; i + 16 <= n; i += 16) {
    const __m256i low = bf16_bits_in_lanes(_mm256_loadu_ps(src + i));
    const __m256i high = bf16_bits_in_lanes(_mm256_loadu_ps(src + i + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xd8));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256i lanes = bf16_bits_in_lanes(_mm256_loadu_ps(src + i));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// master.h's join_bf16_remainder, a vector at a time: the fp32 master of a bf16 param and its
// int16 remainder ([note: remainder encoding]), the remainder dropped where it cannot belong to
// the param: a zero param with a negative one, an infinite param with a positive one ([note:
// edited params]).
[[gnu::always_inline]] inline void remainder_tile_to_float(const uint16_t* high, const int16_t* remainder,
                                                           float* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  const __mmask16 all = 0xffff;  // the maskz forms: see fp16_tile_to_float
  for (; i + 16 <= n; i += 16) {
    const __m256i high_halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + i));
    const __m256i low_halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(remainder + i));
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(all, high_halves);
    const __m512i low = _mm512_maskz_cvtepi16_epi32(all, low_halves);
    const __m512i magnitude = _mm512_and_si512(wide, _mm512_set1_epi32(0x7fff));
    const __m512i zero = _mm512_setzero_si512();
    const __mmask16 edited =
        (_mm512_cmpeq_epi32_mask(magnitude, zero) & _mm512_cmplt_epi32_mask(low, zero)) |
        (_mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7f80)) & _mm512_cmpgt_epi32_mask(low, zero));
    const __m512i top = _mm512_maskz_slli_epi32(all, wide, 16);
    _mm512_storeu_si512(dst + i, _mm512_mask_add_epi32(top, _knot_mask16(edited), top, low));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    const __m128i high_halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + i));
    const __m128i low_halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(remainder + i));
    const __m256i wide = _mm256_cvtepu16_epi32(high_halves);
    const __m256i low = _mm256_cvtepi16_epi32(low_halves);
    const __m256i magnitude = _mm256_and_si256(wide, _mm256_set1_epi32(0x7fff));
    const __m256i zero = _mm256_setzero_si256();
    const __m256i edited = _mm256_or_si256(
        _mm256_and_si256(_mm256_cmpeq_epi32(magnitude, zero), _mm256_cmpgt_epi32(zero, low)),
        _mm256_and_si256(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7f80)), _mm256_cmpgt_epi32(low, zero)));
    const __m256i top = _mm256_slli_epi32(wide, 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_add_epi32(top, _mm256_andnot_si256(edited, low)));
  }
#endif
  for (; i < n; ++i) dst[i] = join_bf16_remainder(high[i], remainder[i]);
}

// master.h's split_bf16_remainder, a vector at a time: high = (bits + 0x8000) >> 16 and
// remainder = bits - (high << 16), which lies within int16; a NaN gives the quiet bf16 NaN
// (bits >> 16) | 0x40 and a zero remainder.
[[gnu::always_inline]] inline void float_tile_to_remainder(const float* src, uint16_t* high,
                                                           int16_t* remainder, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  const __m512i half = _mm512_set1_epi32(0x8000), quiet = _mm512_set1_epi32(0x40);
  const __mmask16 all = 0xffff;  // the maskz forms: see fp16_tile_to_float
  for (; i + 16 <= n; i += 16) {
    const __m512 value = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(value);
    const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    const __m512i rounded = _mm512_maskz_srli_epi32(all, _mm512_add_epi32(bits, half), 16);
    const __m512i top = _mm512_mask_or_epi32(rounded, nan, _mm512_maskz_srli_epi32(all, bits, 16), quiet);
    const __m512i top_bits = _mm512_maskz_slli_epi32(all, top, 16);
    const __m512i low = _mm512_maskz_sub_epi32(_knot_mask16(nan), bits, top_bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i), _mm512_maskz_cvtepi32_epi16(all, top));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(remainder + i), _mm512_maskz_cvtepi32_epi16(all, low));
  }
#elif FUSEDAMP_F16C_LANES == 8
  // Two vectors at a time: one pack and one lane gather narrow both (the remainders as their
  // low 16 bits, so that the unsigned-saturating pack keeps them).
  for (; i + 16 <= n; i += 16) {
    __m256i top[2], low[2];
    for (int part = 0; part < 2; ++part) {
      const __m256 value = _mm256_loadu_ps(src + i + 8 * part);
      const __m256i bits = _mm256_castps_si256(value);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
      const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x8000)), 16);
      const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
      top[part] = _mm256_blendv_epi8(rounded, quiet_nan, nan);
      const __m256i rest = _mm256_sub_epi32(bits, _mm256_slli_epi32(top[part], 16));
      low[part] = _mm256_andnot_si256(nan, _mm256_and_si256(rest, _mm256_set1_epi32(0xffff)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(top[0], top[1]), 0xd8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(remainder + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(low[0], low[1]), 0xd8));
  }
#endif
  for (; i < n; ++i) split_bf16_remainder(src[i], high[i], remainder[i]);
}

// master.h's master_or_edited_param on a tile, in place: where a half param is not its fp32
// master rounded to nearest even (the param was edited outside the step, [note: edited params]),
// the param's value replaces the master. A vector with no edited lane stores nothing.
template <DType P>
[[gnu::always_inline]] inline void reseed_edited_masters(const uint16_t* param, float* master, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  const __mmask16 all = 0xffff;  // the maskz forms: see fp16_tile_to_float
  for (; i + 16 <= n; i += 16) {
    const __m512 value = _mm512_loadu_ps(master + i);
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(param + i));
    __mmask16 edited;
    __m512 widened;
    if constexpr (P == DType::kFloat16) {
      const __m256i rounded = _mm512_maskz_cvtps_ph(all, value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      edited = _mm256_cmpneq_epi16_mask(rounded, halves);
      widened = _mm512_maskz_cvtph_ps(all, halves);
    } else {
      const __m512i bits = _mm512_castps_si512(value);
      const __m512i high = _mm512_maskz_srli_epi32(all, bits, 16);
      const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
      const __m512i rounded = _mm512_maskz_srli_epi32(all, _mm512_add_epi32(bits, bias), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
      const __m512i expected = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
      const __m512i wide = _mm512_maskz_cvtepu16_epi32(all, halves);
      edited = _mm512_cmpneq_epi32_mask(expected, wide);
      widened = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, wide, 16));
    }
    if (edited) _mm512_storeu_ps(master + i, _mm512_mask_mov_ps(value, edited, widened));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    const __m256 value = _mm256_loadu_ps(master + i);
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(param + i));
    __m256i kept;
    __m256 widened;
    if constexpr (P == DType::kFloat16) {
      const __m128i rounded = _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      kept = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(rounded, halves));
      widened = _mm256_cvtph_ps(halves);
    } else {
      const __m256i wide = _mm256_cvtepu16_epi32(halves);
      kept = _mm256_cmpeq_epi32(bf16_bits_in_lanes(value), wide);
      widened = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    if (_mm256_movemask_epi8(kept) != -1) {
      _mm256_storeu_ps(master + i, _mm256_blendv_ps(widened, value, _mm256_castsi256_ps(kept)));
    }
  }
#endif
  for (; i < n; ++i) master[i] = master_or_edited_param<P>(master[i], param[i]);
}

template <DType T>
[[gnu::always_inline]] inline void half_tile_to_float(const uint16_t* src, float* dst, int64_t n) {
  if constexpr (T == DType::kFloat16) {
    fp16_tile_to_float(src, dst, n);
  } else {
    bf16_tile_to_float(src, dst, n);
  }
}

template <DType T>
[[gnu::always_inline]] inline void float_tile_to_half(const float* src, uint16_t* dst, int64_t n) {
  if constexpr (T == DType::kFloat16) {
    float_tile_to_fp16(src, dst, n);
  } else {
    float_tile_to_bf16(src, dst, n);
  }
}

// The element type the math sees after staging ([note: half staging]).
template <DType T>
constexpr DType staged = (kStageHalf && T != DType::kFloat32) ? DType::kFloat32 : T;
// The same for read-only passes, which only widen: bf16 widens with one shift in the loop.
template <DType T>
constexpr DType staged_read = (kStageHalf && T == DType::kFloat16) ? DType::kFloat32 : T;
// A staged bf16 param with a remainder master is joined with it into one fp32 value, which the
// math then updates as a param without a master (split again by unstage_tile).
template <DType P, MasterKind M>
constexpr MasterKind staged_master =
    (P != staged<P> && M == MasterKind::kRemainder) ? MasterKind::kNone : M;

// Pointers of one optimizer tensor moved to element `offset`, with half params and grads
// replaced by fp32 tile buffers (see [note: half staging]). The param is converted in only when
// the math reads it: not when an fp32 master holds the value (it is compared with the master,
// [note: edited params]), joined with its remainder when one completes it.
template <DType P, DType G, MasterKind M, typename Pointers>
[[gnu::always_inline]] inline Pointers staged_tile(const Pointers& t, int64_t offset, int64_t n,
                                                   float* param_tile, float* grad_tile) {
  Pointers s = t;
  s.param = static_cast<storage_t<P>*>(t.param) + offset;
  s.grad = static_cast<storage_t<G>*>(t.grad) + offset;
  if constexpr (M != MasterKind::kNone) s.master = static_cast<master_storage_t<M>*>(t.master) + offset;
  if constexpr (P != staged<P>) {
    if constexpr (M == MasterKind::kNone) {
      half_tile_to_float<P>(static_cast<uint16_t*>(s.param), param_tile, n);
    } else if constexpr (M == MasterKind::kFloat32) {
      reseed_edited_masters<P>(static_cast<uint16_t*>(s.param), static_cast<float*>(s.master), n);
    } else if constexpr (M == MasterKind::kRemainder) {
      remainder_tile_to_float(static_cast<uint16_t*>(s.param), static_cast<int16_t*>(s.master),
                              param_tile, n);
    }
    s.param = param_tile;
  }
  if constexpr (G != staged<G>) {
    half_tile_to_float<G>(static_cast<uint16_t*>(s.grad), grad_tile, n);
    s.grad = grad_tile;
  }
  return s;
}

// Writes a tile's staged half param (split into param and remainder when a remainder completes
// it) and grad (when the step writes grads) back.
template <DType P, DType G, MasterKind M, typename Pointers>
[[gnu::always_inline]] inline void unstage_tile(const Pointers& t, int64_t offset, int64_t n,
                                                const float* param_tile, const float* grad_tile,
                                                bool write_grad) {
  if constexpr (P != staged<P> && M == MasterKind::kRemainder) {
    float_tile_to_remainder(param_tile, static_cast<uint16_t*>(t.param) + offset,
                            static_cast<int16_t*>(t.master) + offset, n);
  } else if constexpr (P != staged<P>) {
    float_tile_to_half<P>(param_tile, static_cast<uint16_t*>(t.param) + offset, n);
  }
  if constexpr (G != staged<G>) {
    if (write_grad) float_tile_to_half<G>(grad_tile, static_cast<uint16_t*>(t.grad) + offset, n);
  }
}

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

// [note: block staging] The optimizer modes with coded states (bf16 or 8-bit moments,
// math/codec.h) or stochastically rounded params run a chunk one codec block (kCodecBlock
// elements) at a time, in groups of kBlockGroup ([note: group staging]): each state, param and
// grad of a group is staged as fp32 here, the optimizer's math runs on them, and they are stored
// back through the same codecs. The codec is a parameter of these helpers, so every optimizer
// gets every codec at once, and a block's scale is computed from the whole block after its
// update.
namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// [note: vector codes] codec.h's encode_code and decode_code, a vector at a time: the same integer
// steps on the fp32 bit patterns, so the codes are bitwise those of the element functions (which
// the baseline build and each tile's tail use). g++ vectorized the element loops into 64-lane byte
// shuffles with register spills: the int8 AdamW step took twice the fp32-moment one.
#if FUSEDAMP_F16C_LANES == 16
constexpr int64_t kCodeLanes = 16;
using CodeLanes = __m512i;
[[gnu::always_inline]] inline CodeLanes load_code_lanes(const uint8_t* codes) {
  return _mm512_maskz_cvtepu8_epi32(__mmask16(0xffff), _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
// Sign-extended: a code with its top bit set fills bits 31..7 of its lane.
[[gnu::always_inline]] inline CodeLanes load_signed_code_lanes(const uint8_t* codes) {
  return _mm512_maskz_cvtepi8_epi32(__mmask16(0xffff), _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
[[gnu::always_inline]] inline void store_code_lanes(uint8_t* codes, CodeLanes lanes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_maskz_cvtepi32_epi8(__mmask16(0xffff), lanes));
}
[[gnu::always_inline]] inline CodeLanes lanes_of(uint32_t value) { return _mm512_set1_epi32(int32_t(value)); }
[[gnu::always_inline]] inline CodeLanes load_bit_lanes(const float* values) {
  return _mm512_castps_si512(_mm512_loadu_ps(values));
}
// a where `pick` (a lane mask from the comparisons below), else b.
using LaneMask = __mmask16;
[[gnu::always_inline]] inline CodeLanes select_lanes(LaneMask pick, CodeLanes a, CodeLanes b) {
  return _mm512_mask_blend_epi32(pick, b, a);
}
// a where `pick`, else 0.
[[gnu::always_inline]] inline CodeLanes keep_lanes(LaneMask pick, CodeLanes a) { return _mm512_maskz_mov_epi32(pick, a); }
[[gnu::always_inline]] inline LaneMask all_lanes() { return __mmask16(0xffff); }
// store_code_lanes of keep_lanes(kept, codes): the narrowing zeroes the other lanes.
[[gnu::always_inline]] inline void store_kept_code_lanes(uint8_t* out, LaneMask kept, CodeLanes codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(kept, codes));
}
[[gnu::always_inline]] inline LaneMask lanes_at_least(CodeLanes a, uint32_t bound) {
  return _mm512_cmpge_epi32_mask(a, lanes_of(bound));
}
[[gnu::always_inline]] inline LaneMask lanes_equal(CodeLanes a, uint32_t value) {
  return _mm512_cmpeq_epi32_mask(a, lanes_of(value));
}
[[gnu::always_inline]] inline LaneMask lanes_below(CodeLanes a, uint32_t bound) {
  return _mm512_cmplt_epi32_mask(a, lanes_of(bound));
}
[[gnu::always_inline]] inline LaneMask lanes_nonzero(CodeLanes a) { return _mm512_test_epi32_mask(a, a); }
// The lanes of a with none of `bits` set.
[[gnu::always_inline]] inline LaneMask lanes_without(CodeLanes a, uint32_t bits) {
  return _mm512_testn_epi32_mask(a, lanes_of(bits));
}
[[gnu::always_inline]] inline LaneMask no_lanes() { return 0; }
[[gnu::always_inline]] inline bool any_lane(LaneMask m) { return m != 0; }
[[gnu::always_inline]] inline LaneMask both(LaneMask a, LaneMask b) { return a & b; }
[[gnu::always_inline]] inline CodeLanes shift_right(CodeLanes a, int bits) {
  return _mm512_maskz_srli_epi32(__mmask16(0xffff), a, bits);  // the maskz forms: see fp16_tile_to_float
}
[[gnu::always_inline]] inline CodeLanes shift_left(CodeLanes a, int bits) {
  return _mm512_maskz_slli_epi32(__mmask16(0xffff), a, bits);
}
[[gnu::always_inline]] inline CodeLanes shift_right_signed(CodeLanes a, int bits) {
  return _mm512_maskz_srai_epi32(__mmask16(0xffff), a, bits);
}
// a | (b & mask), one instruction.
[[gnu::always_inline]] inline CodeLanes or_masked(CodeLanes a, CodeLanes b, uint32_t mask) {
  return _mm512_ternarylogic_epi32(a, b, lanes_of(mask), 0xf8);
}
[[gnu::always_inline]] inline CodeLanes add_lanes(CodeLanes a, CodeLanes b) { return _mm512_add_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes sub_lanes(CodeLanes a, CodeLanes b) { return _mm512_sub_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes and_lanes(CodeLanes a, CodeLanes b) { return _mm512_and_si512(a, b); }
[[gnu::always_inline]] inline CodeLanes min_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_maskz_min_epi32(__mmask16(0xffff), a, b);
}
[[gnu::always_inline]] inline CodeLanes max_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_maskz_max_epi32(__mmask16(0xffff), a, b);  // the maskz forms: see fp16_tile_to_float
}
// The lanes as unsigned 32-bit integers: their maximum, and the largest lane.
[[gnu::always_inline]] inline CodeLanes max_unsigned_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_maskz_max_epu32(__mmask16(0xffff), a, b);
}
[[gnu::always_inline]] inline uint32_t max_unsigned_of_lanes(CodeLanes a) {
  const __m256i half = _mm256_max_epu32(_mm512_maskz_extracti64x4_epi64(__mmask8(0xff), a, 0),
                                        _mm512_maskz_extracti64x4_epi64(__mmask8(0xff), a, 1));
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
}
// a | b in the lanes of `pick`, a elsewhere.
[[gnu::always_inline]] inline CodeLanes or_where(LaneMask pick, CodeLanes a, CodeLanes b) {
  return _mm512_mask_or_epi32(a, pick, a, b);
}
// Whether any of n codes has none of `bits` set.
[[gnu::always_inline]] inline bool any_code_without(const uint8_t* codes, int64_t n, uint8_t bits) {
  const __m512i wanted = _mm512_set1_epi8(char(bits));
  __mmask64 found = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) found |= _mm512_testn_epi8_mask(_mm512_loadu_si512(codes + i), wanted);
  if (i < n) {
    const __mmask64 tail = _bzhi_u64(~0ull, unsigned(n - i));
    found |= _mm512_mask_testn_epi8_mask(tail, _mm512_maskz_loadu_epi8(tail, codes + i), wanted);
  }
  return found != 0;
}
[[gnu::always_inline]] inline CodeLanes mul_as_floats(CodeLanes a, float b) {
  return _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(b)));
}
[[gnu::always_inline]] inline void store_bit_lanes(float* values, CodeLanes a) {
  _mm512_storeu_ps(values, _mm512_castsi512_ps(a));
}
[[gnu::always_inline]] inline CodeLanes xor_lanes(CodeLanes a, CodeLanes b) { return _mm512_xor_si512(a, b); }
[[gnu::always_inline]] inline CodeLanes mul_lanes(CodeLanes a, uint32_t b) {
  return _mm512_maskz_mullo_epi32(__mmask16(0xffff), a, lanes_of(b));
}
[[gnu::always_inline]] inline CodeLanes lane_indices() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// The low 16 bits of each lane to kCodeLanes halves.
[[gnu::always_inline]] inline void store_half_lanes(uint16_t* halves, CodeLanes a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves), _mm512_maskz_cvtepi32_epi16(__mmask16(0xffff), a));
}
#elif FUSEDAMP_F16C_LANES == 8
constexpr int64_t kCodeLanes = 8;
using CodeLanes = __m256i;
[[gnu::always_inline]] inline CodeLanes load_code_lanes(const uint8_t* codes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}
[[gnu::always_inline]] inline CodeLanes load_signed_code_lanes(const uint8_t* codes) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
}
[[gnu::always_inline]] inline void store_code_lanes(uint8_t* codes, CodeLanes lanes) {
  // The low byte of each 32-bit lane to the low 4 bytes of its 128-bit half, then both halves joined.
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(lanes, gather);
  const __m128i joined = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), joined);
}
[[gnu::always_inline]] inline CodeLanes lanes_of(uint32_t value) { return _mm256_set1_epi32(int32_t(value)); }
[[gnu::always_inline]] inline CodeLanes load_bit_lanes(const float* values) {
  return _mm256_castps_si256(_mm256_loadu_ps(values));
}
// Comparisons give all-ones lanes; every value compared here is below 2^31, so signed compares
// order them as codec.h's unsigned ones do.
using LaneMask = __m256i;
[[gnu::always_inline]] inline CodeLanes select_lanes(LaneMask pick, CodeLanes a, CodeLanes b) {
  return _mm256_blendv_epi8(b, a, pick);
}
[[gnu::always_inline]] inline CodeLanes keep_lanes(LaneMask pick, CodeLanes a) { return _mm256_and_si256(a, pick); }
[[gnu::always_inline]] inline LaneMask lanes_at_least(CodeLanes a, uint32_t bound) {
  return _mm256_cmpgt_epi32(a, lanes_of(bound - 1));
}
[[gnu::always_inline]] inline LaneMask lanes_equal(CodeLanes a, uint32_t value) {
  return _mm256_cmpeq_epi32(a, lanes_of(value));
}
[[gnu::always_inline]] inline LaneMask lanes_below(CodeLanes a, uint32_t bound) {
  return _mm256_cmpgt_epi32(lanes_of(bound), a);
}
[[gnu::always_inline]] inline LaneMask lanes_nonzero(CodeLanes a) {
  return _mm256_xor_si256(_mm256_cmpeq_epi32(a, _mm256_setzero_si256()), lanes_of(0xffffffffu));
}
[[gnu::always_inline]] inline LaneMask lanes_without(CodeLanes a, uint32_t bits) {
  return _mm256_cmpeq_epi32(_mm256_and_si256(a, lanes_of(bits)), _mm256_setzero_si256());
}
[[gnu::always_inline]] inline LaneMask no_lanes() { return _mm256_setzero_si256(); }
[[gnu::always_inline]] inline bool any_lane(LaneMask m) { return !_mm256_testz_si256(m, m); }
[[gnu::always_inline]] inline LaneMask both(LaneMask a, LaneMask b) { return _mm256_and_si256(a, b); }
[[gnu::always_inline]] inline CodeLanes shift_right(CodeLanes a, int bits) { return _mm256_srli_epi32(a, bits); }
[[gnu::always_inline]] inline CodeLanes shift_left(CodeLanes a, int bits) { return _mm256_slli_epi32(a, bits); }
[[gnu::always_inline]] inline CodeLanes shift_right_signed(CodeLanes a, int bits) { return _mm256_srai_epi32(a, bits); }
[[gnu::always_inline]] inline CodeLanes or_masked(CodeLanes a, CodeLanes b, uint32_t mask) {
  return _mm256_or_si256(a, _mm256_and_si256(b, lanes_of(mask)));
}
[[gnu::always_inline]] inline CodeLanes add_lanes(CodeLanes a, CodeLanes b) { return _mm256_add_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes sub_lanes(CodeLanes a, CodeLanes b) { return _mm256_sub_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes and_lanes(CodeLanes a, CodeLanes b) { return _mm256_and_si256(a, b); }
[[gnu::always_inline]] inline CodeLanes min_lanes(CodeLanes a, CodeLanes b) { return _mm256_min_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes max_lanes(CodeLanes a, CodeLanes b) { return _mm256_max_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes max_unsigned_lanes(CodeLanes a, CodeLanes b) { return _mm256_max_epu32(a, b); }
[[gnu::always_inline]] inline uint32_t max_unsigned_of_lanes(CodeLanes a) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
}
[[gnu::always_inline]] inline CodeLanes or_where(LaneMask pick, CodeLanes a, CodeLanes b) {
  return _mm256_or_si256(a, _mm256_and_si256(b, pick));
}
[[gnu::always_inline]] inline bool any_code_without(const uint8_t* codes, int64_t n, uint8_t bits) {
  const __m256i wanted = _mm256_set1_epi8(char(bits));
  __m256i found = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i loaded = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    found = _mm256_or_si256(found, _mm256_cmpeq_epi8(_mm256_and_si256(loaded, wanted), _mm256_setzero_si256()));
  }
  bool any = !_mm256_testz_si256(found, found);
  for (; i < n; ++i) any |= (codes[i] & bits) == 0;
  return any;
}
[[gnu::always_inline]] inline CodeLanes mul_as_floats(CodeLanes a, float b) {
  return _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(b)));
}
[[gnu::always_inline]] inline void store_bit_lanes(float* values, CodeLanes a) {
  _mm256_storeu_ps(values, _mm256_castsi256_ps(a));
}
[[gnu::always_inline]] inline CodeLanes xor_lanes(CodeLanes a, CodeLanes b) { return _mm256_xor_si256(a, b); }
[[gnu::always_inline]] inline CodeLanes mul_lanes(CodeLanes a, uint32_t b) {
  return _mm256_mullo_epi32(a, lanes_of(b));
}
[[gnu::always_inline]] inline CodeLanes lane_indices() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
// The low 16 bits of each lane (each below 2^16, which the unsigned-saturating pack keeps) to
// kCodeLanes halves.
[[gnu::always_inline]] inline void store_half_lanes(uint16_t* halves, CodeLanes a) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, a), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(halves), _mm256_castsi256_si128(packed));
}
[[gnu::always_inline]] inline LaneMask all_lanes() { return lanes_of(0xffffffffu); }
[[gnu::always_inline]] inline void store_kept_code_lanes(uint8_t* out, LaneMask kept, CodeLanes codes) {
  store_code_lanes(out, keep_lanes(kept, codes));
}
// Two vectors of codes (each below 256) as 2 * kCodeLanes bytes, in three shuffles instead of
// store_code_lanes' three per vector: a pack to words ([a0-3 b0-3 | a4-7 b4-7]), one to bytes
// (each 128-bit half twice), and a gather of the dwords in order.
[[gnu::always_inline]] inline void store_code_lane_pair(uint8_t* out, CodeLanes a, CodeLanes b) {
  const __m256i words = _mm256_packus_epi32(a, b);
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(ordered));
}
#endif

#if FUSEDAMP_F16C_LANES
// stochastic.h's rounding_bits and float_to_bf16_stochastic, a vector at a time (g++ split the
// element loop into 8-lane halves with stack spills: the stochastic steps ran at a third of the
// stream ceiling). `elements`: the element index of each lane, as rounding_bits truncates it.
[[gnu::always_inline]] inline CodeLanes rounding_bit_lanes(uint32_t key, CodeLanes elements) {
  CodeLanes x = xor_lanes(elements, lanes_of(key));
  x = xor_lanes(x, shift_right(x, 16));
  x = mul_lanes(x, 0x7feb352du);
  x = xor_lanes(x, shift_right(x, 15));
  x = mul_lanes(x, 0x846ca68bu);
  return xor_lanes(x, shift_right(x, 16));
}


// What encode_code's rounding adds to the next kCodeLanes values of elements from first_element:
// half a step, or (kStochastic) stochastic_code_rounding of each element's bits under `key`.
template <bool kStochastic>
[[gnu::always_inline]] inline CodeLanes code_rounding_lanes(uint32_t key, int64_t first_element) {
  if constexpr (kStochastic) {
    const CodeLanes elements = add_lanes(lanes_of(uint32_t(first_element)), lane_indices());
    return shift_right(rounding_bit_lanes(key, elements), 12);
  } else {
    return lanes_of(kNearestCodeRounding);
  }
}

// float_to_bf16_state a vector at a time: the bf16 bits in the low half of each lane.
[[gnu::always_inline]] inline CodeLanes bf16_state_lanes(CodeLanes bits, CodeLanes random) {
  CodeLanes result = shift_right(add_lanes(bits, and_lanes(random, lanes_of(0xffffu))), 16);
  const LaneMask nan = lanes_at_least(and_lanes(bits, lanes_of(0x7fffffffu)), 0x7f800001u);
  if (any_lane(nan)) result = select_lanes(nan, lanes_of(0x7fc0u), result);
  return result;
}
#endif

// fp32 values to a bf16 state, rounded stochastically with the bits of elements
// [first_element, first_element + n) under `key` ([note: unbiased state rounding]).
[[gnu::always_inline]] inline void float_tile_to_bf16_state(const float* src, uint16_t* dst, int64_t n, uint32_t key,
                                                            int64_t first_element) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  const CodeLanes lane_index = lane_indices();
  for (; i + kCodeLanes <= n; i += kCodeLanes) {
    const CodeLanes elements = add_lanes(lanes_of(uint32_t(first_element + i)), lane_index);
    store_half_lanes(dst + i, bf16_state_lanes(load_bit_lanes(src + i), rounding_bit_lanes(key, elements)));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_bf16_state(src[i], rounding_bits(key, first_element + i));
}

// What encoding a block of codes needs to know of its values: the top exponent (codec.h's
// block_top_exponent of its largest finite magnitude) and whether every value is plain: finite,
// and in an unsigned state also without its sign bit (MagnitudeMax).
struct BlockTop {
  uint32_t exponent;
  bool plain;
};

#if FUSEDAMP_F16C_LANES
// The forms of the vector encoder, by what a block's values allow.
enum class EncodeForm {
  kGeneral,  // any block, all-zero ones included
  // top > kTopExponent: a value below fp32's normal range rounds to at most 0x87ffff, so its code
  // is below 8 and `code >= 8` alone decides what a value keeps (the blocks of any real moment).
  // The offset is folded into the rounding constant: (m + 0x80000 - (offset << 20)) >> 20
  // (arithmetic) is (m + 0x80000) >> 20 - offset exactly, and cannot overflow.
  kNormal,
  // kNormal with every value plain (BlockTop) and top < 254 (so not clamped by block_top_exponent):
  // no lane needs the non-finite codes, no code exceeds the top binade, so none is clamped, and
  // an unsigned state's bits are its magnitudes.
  kFiniteNormal,
};

// A vector of codes; the lanes outside `kept` are 0, which the store writes (on AVX-512 the
// narrowing store zeroes them: one instruction fewer than a select before it).
struct CodeVector {
  CodeLanes codes;
  LaneMask kept;
};

[[gnu::always_inline]] inline void store_code_vector(uint8_t* out, const CodeVector& v) {
  store_kept_code_lanes(out, v.kept, v.codes);
}

// encode_code on the next kCodeLanes values of a block of top exponent `top`, each magnitude
// rounded by its lane of `rounding` (code_rounding_lanes).
template <bool kSigned, EncodeForm kForm>
[[gnu::always_inline]] inline CodeVector encode_code_lanes(const float* values, uint32_t top, CodeLanes rounding) {
  using Code = BlockCode<kSigned>;
  const uint32_t offset = uint32_t(int32_t(top) - Code::kTopExponent) * 8u;
  const CodeLanes bits = load_bit_lanes(values);
  const CodeLanes magnitude =
      !kSigned && kForm == EncodeForm::kFiniteNormal ? bits : and_lanes(bits, lanes_of(0x7fffffffu));
  CodeLanes result;
  LaneMask kept = all_lanes();
  if constexpr (kForm != EncodeForm::kGeneral) {
    const CodeLanes rounded = add_lanes(add_lanes(magnitude, rounding), lanes_of(0u - (offset << 20)));
    CodeLanes code = shift_right_signed(rounded, 20);
    if constexpr (kForm == EncodeForm::kNormal) code = min_lanes(code, lanes_of(Code::kMagnitudeMask));
    if constexpr (kSigned && kForm == EncodeForm::kFiniteNormal) {
      // The sign goes on every lane, the code only on those it keeps: one masked or.
      const CodeLanes sign = and_lanes(shift_right(bits, 24), lanes_of(0x80u));
      return {or_where(lanes_at_least(code, 8), sign, code), all_lanes()};
    } else if constexpr (kSigned) {
      result = keep_lanes(lanes_at_least(code, 8), code);
    } else {
      // A zero stays 0 (outside `kept`); any other value keeps at least the smallest code.
      result = max_lanes(code, lanes_of(Code::kSmallest));
      kept = lanes_nonzero(magnitude);
    }
  } else {
    const CodeLanes rounded = add_lanes(magnitude, rounding);
    const CodeLanes code =
        min_lanes(sub_lanes(shift_right(rounded, 20), lanes_of(offset)), lanes_of(Code::kMagnitudeMask));
    const LaneMask representable =
        top != 0 ? both(lanes_at_least(code, 8), lanes_at_least(magnitude, 0x00800000u)) : no_lanes();
    const CodeLanes flushed =
        kSigned ? lanes_of(0) : keep_lanes(lanes_nonzero(magnitude), lanes_of(Code::kSmallest));
    result = select_lanes(representable, code, flushed);
  }
  if constexpr (kSigned) result = or_masked(result, shift_right(bits, 24), 0x80u);
  if constexpr (kForm != EncodeForm::kFiniteNormal) {
    const LaneMask non_finite = lanes_at_least(magnitude, 0x7f800000u);
    if (any_lane(non_finite)) {
      // An inf keeps its sign, a NaN is the one unsigned NaN code (encode_code).
      CodeLanes inf = lanes_of(Code::kInf);
      if constexpr (kSigned) inf = or_masked(inf, shift_right(bits, 24), 0x80u);
      const CodeLanes special = select_lanes(lanes_equal(magnitude, 0x7f800000u), inf, lanes_of(Code::kNan));
      result = select_lanes(non_finite, special, result);
    }
  }
  return {result, kept};
}

// What decode_code gives for the codes of E = 0 (zero, NaN, inf), with their signs.
template <bool kSigned>
[[gnu::always_inline]] inline CodeLanes special_code_values(CodeLanes codes) {
  using Code = BlockCode<kSigned>;
  const CodeLanes magnitude = and_lanes(codes, lanes_of(Code::kMagnitudeMask));
  const CodeLanes nan_or_inf =
      select_lanes(lanes_equal(magnitude, Code::kNan), lanes_of(0x7fc00000u), lanes_of(0x7f800000u));
  CodeLanes value = select_lanes(lanes_equal(magnitude, 0), lanes_of(0), nan_or_inf);
  if constexpr (kSigned) value = or_masked(value, shift_left(codes, 24), 0x80000000u);
  return value;
}

// decode_code on a vector of codes (one per 32-bit lane), as fp32 bit patterns.
template <bool kSigned>
[[gnu::always_inline]] inline CodeLanes decode_code_lanes(CodeLanes codes, float scale) {
  using Code = BlockCode<kSigned>;
  const CodeLanes magnitude = and_lanes(codes, lanes_of(Code::kMagnitudeMask));
  const CodeLanes relative =
      add_lanes(shift_left(magnitude, 20), lanes_of(uint32_t(127 - Code::kTopExponent) << 23));
  CodeLanes result = mul_as_floats(relative, scale);
  if constexpr (kSigned) result = or_masked(result, shift_left(codes, 24), 0x80000000u);
  const LaneMask special = lanes_below(magnitude, 8);
  if (any_lane(special)) result = select_lanes(special, special_code_values<kSigned>(codes), result);
  return result;
}

// decode_code on the next kCodeLanes codes of a block decoded by an exponent add ([note: normal
// decode]): E and M shifted into place under the sign, plus the offset. kSpecialCodes: some code
// of the block may have E = 0, so the lanes are checked for them.
template <bool kSigned, bool kSpecialCodes>
[[gnu::always_inline]] inline CodeLanes decode_normal_code_lanes(const uint8_t* codes, uint32_t exponent_offset) {
  CodeLanes code, result;
  if constexpr (kSigned) {
    // Sign-extended, (code << 20) holds the sign in bits 31..27 and E, M in bits 26..20.
    code = load_signed_code_lanes(codes);
    result = add_lanes(and_lanes(shift_left(code, 20), lanes_of(0x87ffffffu)), lanes_of(exponent_offset));
  } else {
    code = load_code_lanes(codes);
    result = add_lanes(shift_left(code, 20), lanes_of(exponent_offset));
  }
  if constexpr (kSpecialCodes) {
    const LaneMask special = kSigned ? lanes_without(code, 0x78u) : lanes_below(code, 8);
    if (any_lane(special)) result = select_lanes(special, special_code_values<kSigned>(code), result);
  }
  return result;
}
#endif

// [note: normal decode] decode_code multiplies a code's value relative to the top binade by its
// block's scale. When the scale is a power of two 2^(top - 127) with kTopExponent <= top <= 254,
// every product is a normal fp32 number, so the multiply is exact and is an add of
// (top - kTopExponent) << 23 to the relative value's bits: the vector decoders then add that
// offset to the shifted code instead of building the relative value and multiplying. Every scale
// a step writes is such a power of two unless its block is tiny or all zero.
constexpr uint32_t kGeneralDecode = 0xffffffffu;

// The exponent offset that decodes a block of this scale by an add, or kGeneralDecode.
template <bool kSigned>
[[gnu::always_inline]] inline uint32_t normal_decode_offset(float scale) {
  const uint32_t bits = float_bits(scale);
  const uint32_t top = bits >> 23;
  const bool power_of_two = (bits & 0x807fffffu) == 0u;
  return power_of_two && top >= uint32_t(BlockCode<kSigned>::kTopExponent) && top <= 254u
             ? (top - uint32_t(BlockCode<kSigned>::kTopExponent)) << 23
             : kGeneralDecode;
}

// How the vector decoders take a block's codes.
struct BlockDecode {
  uint32_t exponent_offset;  // normal_decode_offset of the block's scale, or kGeneralDecode
  bool special_codes;        // some code may have E = 0 (zero, NaN, inf): each vector is checked
};

// The BlockDecode of a block's n codes of this scale. A block that decodes by the add is scanned
// once for codes of E = 0, so that its vectors need no check when it has none (a moment's blocks
// seldom have any: 2 instructions fewer per vector and state).
template <bool kSigned>
[[gnu::always_inline]] inline BlockDecode block_decode_of(const uint8_t* codes, float scale, int64_t n) {
  const uint32_t offset = normal_decode_offset<kSigned>(scale);
  bool special_codes = true;
#if FUSEDAMP_F16C_LANES
  if (offset != kGeneralDecode) {
    special_codes = any_code_without(codes, n, uint8_t(BlockCode<kSigned>::kMagnitudeMask & ~7u));
  }
#endif
  return {offset, special_codes};
}

// The running maximum of the magnitude bits (non-finite ones included) of a block's values, folded
// in a group of values at a time. An unsigned state's maximum is taken over the raw bits: its
// values are not negative, and one with its sign bit set (a -0 or a NaN) makes the block not
// plain (BlockTop), so block_top_of looks again; that saves the mask in the busiest loop.
// (Its members are set by reset(): an implicit constructor would miss the build's target pragma.)
template <bool kSigned>
struct MagnitudeMax {
  static constexpr uint32_t kMask = kSigned ? 0x7fffffffu : 0xffffffffu;

#if FUSEDAMP_F16C_LANES
  CodeLanes lanes;
#endif
  uint32_t rest;

  [[gnu::always_inline]] MagnitudeMax() { reset(); }

  [[gnu::always_inline]] void reset() {
#if FUSEDAMP_F16C_LANES
    lanes = lanes_of(0);
#endif
    rest = 0;
  }

  [[gnu::always_inline]] void fold(const float* values, int64_t n) {
    int64_t i = 0;
#if FUSEDAMP_F16C_LANES
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      const CodeLanes bits = load_bit_lanes(values + i);
      lanes = max_unsigned_lanes(lanes, kSigned ? and_lanes(bits, lanes_of(kMask)) : bits);
    }
#endif
    for (; i < n; ++i) rest = std::max(rest, float_bits(values[i]) & kMask);
  }

  [[gnu::always_inline]] uint32_t bits() const {
#if FUSEDAMP_F16C_LANES
    return std::max(max_unsigned_of_lanes(lanes), rest);
#else
    return rest;
#endif
  }
};

// The top of a block (n <= kCodecBlock values) whose MagnitudeMax is max_bits: that of its largest
// finite magnitude (only a block that holds a value that is not plain looks again for it), for
// codes rounded by at most max_rounding (block_top_exponent).
[[gnu::always_inline]] inline BlockTop block_top_of(const float* values, int64_t n, uint32_t max_bits,
                                                    uint32_t max_rounding) {
  const bool plain = max_bits < 0x7f800000u;
  if (!plain) {
    max_bits = 0;
    for (int64_t i = 0; i < n; ++i) max_bits = std::max(max_bits, finite_magnitude_bits(values[i]));
  }
  return {block_top_exponent(max_bits, max_rounding), plain};
}

#if FUSEDAMP_F16C_LANES
// encode_code_lanes over the whole vectors of n values of elements from first_element; returns
// how many values they took.
template <bool kSigned, bool kStochastic, EncodeForm kForm>
[[gnu::always_inline]] inline int64_t encode_code_vectors(const float* values, int64_t n, uint32_t top,
                                                          uint8_t* codes, uint32_t key, int64_t first_element) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 8
  for (; i + 2 * kCodeLanes <= n; i += 2 * kCodeLanes) {
    const CodeVector a = encode_code_lanes<kSigned, kForm>(
        values + i, top, code_rounding_lanes<kStochastic>(key, first_element + i));
    const CodeVector b = encode_code_lanes<kSigned, kForm>(
        values + i + kCodeLanes, top, code_rounding_lanes<kStochastic>(key, first_element + i + kCodeLanes));
    store_code_lane_pair(codes + i, keep_lanes(a.kept, a.codes), keep_lanes(b.kept, b.codes));
  }
#endif
  for (; i + kCodeLanes <= n; i += kCodeLanes) {
    store_code_vector(codes + i, encode_code_lanes<kSigned, kForm>(
                                     values + i, top, code_rounding_lanes<kStochastic>(key, first_element + i)));
  }
  return i;
}
#endif

// The codes of n values of a block, elements from first_element: rounded to nearest, or
// (kStochastic) with the random bits of each element under `key`.
template <bool kSigned, bool kStochastic>
[[gnu::always_inline]] inline void encode_codes(const float* values, int64_t n, BlockTop top, uint8_t* codes,
                                                uint32_t key = 0, int64_t first_element = 0) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  if (top.exponent > uint32_t(BlockCode<kSigned>::kTopExponent)) {
    if (top.plain && top.exponent < 254u) {
      i = encode_code_vectors<kSigned, kStochastic, EncodeForm::kFiniteNormal>(values, n, top.exponent, codes, key,
                                                                               first_element);
    } else {
      i = encode_code_vectors<kSigned, kStochastic, EncodeForm::kNormal>(values, n, top.exponent, codes, key,
                                                                         first_element);
    }
  } else {
    i = encode_code_vectors<kSigned, kStochastic, EncodeForm::kGeneral>(values, n, top.exponent, codes, key,
                                                                        first_element);
  }
#endif
  for (; i < n; ++i) {
    const uint32_t rounding = kStochastic ? stochastic_code_rounding(rounding_bits(key, first_element + i))
                                          : kNearestCodeRounding;
    codes[i] = encode_code<kSigned>(values[i], top.exponent, rounding);
  }
}

// A whole block (n <= kCodecBlock values) to codes and its scale.
template <bool kSigned>
[[gnu::always_inline]] inline void encode_state_tile(const float* values, int64_t n, uint8_t* codes, float* scale) {
  MagnitudeMax<kSigned> largest;
  largest.fold(values, n);
  const BlockTop top = block_top_of(values, n, largest.bits(), kNearestCodeRounding);
  encode_codes<kSigned, false>(values, n, top, codes);
  *scale = block_scale(top.exponent);
}

// n codes of a block of this scale and BlockDecode as fp32 values.
template <bool kSigned>
[[gnu::always_inline]] inline void decode_state_tile(const uint8_t* codes, float scale, BlockDecode decode,
                                                     int64_t n, float* values) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  if (decode.exponent_offset != kGeneralDecode && decode.special_codes) {
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      store_bit_lanes(values + i, decode_normal_code_lanes<kSigned, true>(codes + i, decode.exponent_offset));
    }
  } else if (decode.exponent_offset != kGeneralDecode) {
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      store_bit_lanes(values + i, decode_normal_code_lanes<kSigned, false>(codes + i, decode.exponent_offset));
    }
  } else {
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      store_bit_lanes(values + i, decode_code_lanes<kSigned>(load_code_lanes(codes + i), scale));
    }
  }
#endif
  for (; i < n; ++i) values[i] = decode_code<kSigned>(codes[i], scale);
}

// Values a coded step stages at a time inside a codec block: its conversions, math and stores
// stay in registers, and the math's divides and square roots overlap the codec work around them
// ([note: group staging]). Two vectors a state on AVX-512, four on AVX2: one loop body then holds
// independent divide chains, about 8% less time than 16 values on both builds in L1 at 1 thread
// (benchmarks/results/README.md).
constexpr int64_t kBlockGroup = 32;

// [note: group staging] A coded step first ran each stage over a whole block: decode the
// moments, run the math, encode. The math's vdivps and vsqrtps (about 22 cycles per 16 values
// on AVX-512) then ran alone while the codec's integer work waited: the int8 AdamW step cost
// about 1 ns per param even in L2. Now one loop body takes kBlockGroup values through decode,
// math and the block maximum, and encodes the same group of the block before (whose maximum,
// hence scale, is final), so the out-of-order core overlaps the divider with all the codec
// work; a chunk's last block is encoded after its loop. Measured on a 2-core AVX-512 Xeon, int8
// moments, 16.8M fp32 params in 200 tensors, against the fp32-moment step: 1.05x as whole-block
// stages; 1.12-1.15x grouped, encoding each block after its loop; 1.14-1.16x (1 and 2 threads)
// with the encode one block behind; and 1.30-1.35x with no encode at all. The loop is then bound
// by its vector ports, not by the divider: llvm-mca on the AVX-512 loop counts 24 uops per 16
// values on each of ports 0 and 5 against the divider's 22 cycles (vsqrtps + vdivps alone take
// 8 ns per 16 values at 2.1 GHz, 0.5 ns per element). So the codec's forms ([note: normal
// decode], EncodeForm) drop every instruction a block does not need: in a direct A/B on such a
// host the int8 step took about 10% less time (in L2, and from memory at 2 threads), and on the
// AVX2 build 8% less (benchmarks/results/README.md, run 13).

// One codec block of an optimizer state as fp32, a group of values at a time: an fp32 state in
// place; a bf16 one decoded into a tile and stored back group by group; an int8 one decoded
// likewise, its groups' maximum folded in as they come back, and its codes written while the
// next block runs (encode_pending). Made by StagedState::begin_block as a local of the block
// loop, so that its pointers and maximum stay in registers: as members, the code stores
// (uint8_t, which may alias anything) made the compiler reload them for every group. It has a
// constructor so that `StateBlock{}` sets each member by its initializer: as an aggregate it was
// zeroed whole first, which g++ did with `rep stosq` on the AVX2 build, three a block in the
// half-param steps (bf16 params + remainder + int8 moments: 11% of the step's time in L2).
template <StateCodec C, bool kSigned>
struct StateBlock {
  void* state = nullptr;                  // the state at the block's first element
  float* values = nullptr;                // the block's fp32 values: the state itself, or a tile
  int64_t first = 0;                      // the block's first element
  uint32_t key = 0;                       // bf16, int8: the key of the chunk's rounding bits
  float scale = 0.0f;                     // int8: the block's scale
  BlockDecode decode{};                   // int8: how its codes decode
  const float* pending_values = nullptr;  // int8: the block before, to encode; null if none
  uint8_t* pending_codes = nullptr;
  int64_t pending_first = 0;              // int8: the first element of the block before
  BlockTop pending_top{};
  MagnitudeMax<kSigned> largest;

  [[gnu::always_inline]] StateBlock() {}

  // The values of the group of n at `offset` in the block.
  [[gnu::always_inline]] float* stage(int64_t offset, int64_t n) {
    if constexpr (C == StateCodec::kBFloat16) {
      bf16_tile_to_float(static_cast<const uint16_t*>(state) + offset, values + offset, n);
    } else if constexpr (C == StateCodec::kInt8) {
      decode_state_tile<kSigned>(static_cast<const uint8_t*>(state) + offset, scale, decode, n, values + offset);
    }
    return values + offset;
  }

  // Takes back the group that stage() gave, after the math updated it.
  [[gnu::always_inline]] void unstage(int64_t offset, int64_t n) {
    if constexpr (C == StateCodec::kBFloat16) {
      float_tile_to_bf16_state(values + offset, static_cast<uint16_t*>(state) + offset, n, key, first + offset);
    } else if constexpr (C == StateCodec::kInt8) {
      largest.fold(values + offset, n);
    }
  }

  // Writes the codes of values [offset, offset + n) of the block before this one, if any.
  [[gnu::always_inline]] void encode_pending(int64_t offset, int64_t n) {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_values != nullptr) {
        encode_codes<kSigned, true>(pending_values + offset, n, pending_top, pending_codes + offset, key,
                                    pending_first + offset);
      }
    }
  }
};

// The chunk-long part of a staged state: the tiles of the current and the pending block, and
// where the pending block's codes go. `key`: the chunk's rounding key for this state
// (chunk_rounding_key with its RoundingStream, [note: unbiased state rounding]).
template <StateCodec C, bool kSigned>
class StagedState {
 public:
  StagedState(void* state, float* scales, uint32_t key) : state_(state), scales_(scales), key_(key) {}

  // The block of n elements from block_first.
  [[gnu::always_inline]] StateBlock<C, kSigned> begin_block(int64_t block_first, int64_t n) {
    StateBlock<C, kSigned> block{};
    block.first = block_first;
    block.key = key_;
    if constexpr (C == StateCodec::kFloat32) {
      block.state = static_cast<float*>(state_) + block_first;
      block.values = static_cast<float*>(block.state);
    } else if constexpr (C == StateCodec::kBFloat16) {
      block.state = static_cast<uint16_t*>(state_) + block_first;
      block.values = tiles_[0];
    } else {
      block.state = static_cast<uint8_t*>(state_) + block_first;
      block.values = tiles_[current_];
      block.scale = scales_[block_first / kCodecBlock];
      block.decode = block_decode_of<kSigned>(static_cast<const uint8_t*>(block.state), block.scale, n);
      if (pending_n_ != 0) {
        block.pending_values = tiles_[current_ ^ 1];
        block.pending_codes = static_cast<uint8_t*>(state_) + pending_first_;
        block.pending_first = pending_first_;
        block.pending_top = pending_top_;
      }
    }
    return block;
  }

  // Ends `block`, of n values from block_first: the pending block's codes past n are written
  // (this block is a chunk's short last one), and this block, its scale stored, becomes the
  // pending one.
  [[gnu::always_inline]] void end_block(const StateBlock<C, kSigned>& block, int64_t block_first, int64_t n) {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_n_ > n) {
        encode_codes<kSigned, true>(block.pending_values + n, pending_n_ - n, pending_top_, block.pending_codes + n,
                                    key_, pending_first_ + n);
      }
      pending_top_ = block_top_of(block.values, n, block.largest.bits(), kMaxStochasticCodeRounding);
      scales_[block_first / kCodecBlock] = block_scale(pending_top_.exponent);
      pending_first_ = block_first;
      pending_n_ = n;
      current_ ^= 1;
    }
  }

  // Writes the codes of the chunk's last block.
  [[gnu::always_inline]] void finish() {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_n_ != 0) {
        encode_codes<kSigned, true>(tiles_[current_ ^ 1], pending_n_, pending_top_,
                                    static_cast<uint8_t*>(state_) + pending_first_, key_, pending_first_);
      }
      pending_n_ = 0;
    }
  }

 private:
  static constexpr int64_t kTile = C == StateCodec::kFloat32 ? 1 : kCodecBlock;
  void* state_;
  float* scales_;
  uint32_t key_;
  alignas(64) float tiles_[2][kTile];  // the current block's values and the pending block's
  int current_ = 0;
  int64_t pending_first_ = 0;
  int64_t pending_n_ = 0;  // 0: no block pending
  BlockTop pending_top_{};
};

#if FUSEDAMP_F16C_LANES
// The bf16 bits (in the low half of each lane) of fp32 values rounded with `random`; a lane with
// a non-finite value takes float_to_bf16's result, which for an inf is its high half and for a
// NaN that half made quiet (| 0x40).
[[gnu::always_inline]] inline CodeLanes bf16_stochastic_lanes(CodeLanes bits, CodeLanes random) {
  CodeLanes result = shift_right(add_lanes(bits, and_lanes(random, lanes_of(0xffffu))), 16);
  const LaneMask non_finite = lanes_at_least(and_lanes(bits, lanes_of(0x7fffffffu)), 0x7f800000u);
  if (any_lane(non_finite)) {
    const CodeLanes high = shift_right(bits, 16);
    const LaneMask nan = both(non_finite, lanes_nonzero(and_lanes(bits, lanes_of(0x007fffffu))));
    result = select_lanes(non_finite, select_lanes(nan, or_masked(high, lanes_of(0x40u), 0x40u), high), result);
  }
  return result;
}
#endif

// fp32 values to fp16/bf16 params, rounded stochastically with the bits of elements
// [first_element, first_element + n) under `key` (math/stochastic.h); bf16 a vector at a time.
template <DType P>
[[gnu::always_inline]] inline void float_tile_to_half_stochastic(const float* src, uint16_t* dst, int64_t n,
                                                                 uint32_t key, int64_t first_element) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  if constexpr (P == DType::kBFloat16) {
    const CodeLanes lane_index = lane_indices();
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      const CodeLanes elements = add_lanes(lanes_of(uint32_t(first_element + i)), lane_index);
      store_half_lanes(dst + i, bf16_stochastic_lanes(load_bit_lanes(src + i), rounding_bit_lanes(key, elements)));
    }
  }
#endif
  for (; i < n; ++i) {
    dst[i] = float_to_half_stochastic<P>(src[i], rounding_bits(key, first_element + i));
  }
}

// The fp32 values an optimizer updates for a range of a param: the param itself (fp32), its fp32
// master (reseeded where the param was edited, [note: edited params]), or `tile` (a half param,
// joined with its remainder when it has one).
template <DType P, MasterKind M>
[[gnu::always_inline]] inline float* stage_value_block(void* param, void* master, int64_t begin,
                                                       int64_t n, float* tile) {
  if constexpr (P == DType::kFloat32) {
    return static_cast<float*>(param) + begin;
  } else if constexpr (M == MasterKind::kFloat32) {
    reseed_edited_masters<P>(static_cast<const uint16_t*>(param) + begin, static_cast<float*>(master) + begin, n);
    return static_cast<float*>(master) + begin;
  } else if constexpr (M == MasterKind::kRemainder) {
    remainder_tile_to_float(static_cast<const uint16_t*>(param) + begin,
                            static_cast<const int16_t*>(master) + begin, tile, n);
  } else {
    half_tile_to_float<P>(static_cast<const uint16_t*>(param) + begin, tile, n);
  }
  return tile;
}

// Writes a range's updated values back: nothing for fp32 params; the half param rounded from its
// fp32 master, split with its remainder, or rounded to nearest or
// stochastically (rounding_key set) when it has no master.
template <DType P, MasterKind M>
[[gnu::always_inline]] inline void unstage_value_block(void* param, void* master, int64_t begin,
                                                       int64_t n, const float* value, bool stochastic,
                                                       uint32_t rounding_key) {
  if constexpr (P != DType::kFloat32) {
    uint16_t* half = static_cast<uint16_t*>(param) + begin;
    if constexpr (M == MasterKind::kRemainder) {
      float_tile_to_remainder(value, half, static_cast<int16_t*>(master) + begin, n);
    } else if constexpr (M == MasterKind::kFloat32) {
      float_tile_to_half<P>(value, half, n);
    } else if (stochastic) {
      float_tile_to_half_stochastic<P>(value, half, n, rounding_key, begin);
    } else {
      float_tile_to_half<P>(value, half, n);
    }
  }
}

// A range of grads as fp32: the grads themselves (fp32) or `tile`; written back by
// unstage_grad_block when the step writes the grads it used.
template <DType G>
[[gnu::always_inline]] inline float* stage_grad_block(void* grad, int64_t begin, int64_t n, float* tile) {
  if constexpr (G == DType::kFloat32) {
    return static_cast<float*>(grad) + begin;
  } else {
    half_tile_to_float<G>(static_cast<const uint16_t*>(grad) + begin, tile, n);
    return tile;
  }
}

template <DType G>
[[gnu::always_inline]] inline void unstage_grad_block(void* grad, int64_t begin, int64_t n, const float* tile,
                                                      bool write_grad) {
  if constexpr (G != DType::kFloat32) {
    if (write_grad) float_tile_to_half<G>(tile, static_cast<uint16_t*>(grad) + begin, n);
  }
}

// [note: block prefetch] The coded steps do more work per byte than the fp32 ones, and between
// blocks the hardware prefetchers fell behind: the int8 AdamW step read memory at half the fp32
// step's rate. So each block first asks for the lines of the block kPrefetchBlocks ahead in
// every stream the step reads (for writing: each is stored back). Measured on a 2-core AVX-512
// Xeon, int8 moments, 16.8M fp32 params, 2 threads: 14.3 ms a step without, 10.1-10.4 ms at 1
// or 2 blocks ahead, 11.3-12.6 ms at 3 to 8 (the farther lines wait in the fill buffers). The
// plain fp32 steps run their element loop a block at a time behind the same prefetches: the fp32
// SGD step (momentum, 16.8M params) ran at 0.86-0.98x the speed of torch's fused one without them
// and at 1.00-1.11x with them, at 1 and 2 threads, AVX-512 and AVX2 builds. The half-param steps
// stage their groups inside the same prefetched blocks: the SGD step on 16.8M bf16 params with
// fp32 masters (1 thread, same host) took 25.4 ms without and 17.2-19.0 ms with them on the AVX2
// build, 18.0 and 15.6-15.9 ms on the AVX-512 one.
constexpr int64_t kPrefetchBlocks = 2;

template <typename T>
[[gnu::always_inline]] inline void prefetch_block(const void* base, int64_t first, int64_t end) {
  const char* bytes = static_cast<const char*>(base);
  const int64_t stop = std::min(end, first + kCodecBlock) * int64_t(sizeof(T));
  for (int64_t offset = first * int64_t(sizeof(T)); offset < stop; offset += 64) {
    __builtin_prefetch(bytes + offset, 1);
  }
}

// The param (and its master), the grad and `states` of the block kPrefetchBlocks ahead of
// `first`, if [first, end) has one.
template <DType P, DType G, MasterKind M, StateCodec C, typename... States>
[[gnu::always_inline]] inline void prefetch_ahead(int64_t first, int64_t end, const void* param,
                                                  const void* master, const void* grad, States... states) {
  const int64_t ahead = first + kPrefetchBlocks * kCodecBlock;
  if (ahead >= end) return;
  using Code = std::conditional_t<C == StateCodec::kInt8, uint8_t,
                                  std::conditional_t<C == StateCodec::kBFloat16, uint16_t, float>>;
  prefetch_block<storage_t<P>>(param, ahead, end);
  if constexpr (M != MasterKind::kNone) prefetch_block<master_storage_t<M>>(master, ahead, end);
  prefetch_block<storage_t<G>>(grad, ahead, end);
  (prefetch_block<Code>(states, ahead, end), ...);
}

// Calls block(begin, n) for the codec blocks of [begin, end) (begin a multiple of kCodecBlock).
template <typename Block>
[[gnu::always_inline]] inline void for_each_codec_block(int64_t begin, int64_t end, Block&& block) {
  for (int64_t first = begin; first < end; first += kCodecBlock) {
    block(first, end - first < kCodecBlock ? end - first : kCodecBlock);
  }
}

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

// Half staging for the CPU kernel builds ([note: half staging]), in groups of vectors: fp16/bf16
// values (and bf16 params with their remainders) converted to fp32 buffers and back with vector
// instructions, n values at a time (a group: kStageLanes in the plain optimizer steps), and the
// pointers of one optimizer tensor moved onto such buffers. Included by the cpu/ headers and
// csrc/cpu/kernels/*.cpp only, after their ISA preamble.
#pragma once

#include "cpu/lanes.h"
#include "fusedamp/math/master.h"

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

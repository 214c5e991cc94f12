// The 32-bit lane layer of the CPU kernel builds, in vectors: CodeLanes (one vector register of
// kCodeLanes 32-bit lanes, 16 on AVX-512 and 8 on AVX2), LaneMask, and the integer operations that
// the vector codec (cpu/codec.h) and the stochastic roundings are written in, with the same names
// on each ISA build. Included by the cpu/ headers only, after a kernel file's ISA preamble (whose
// cpu/isa/common.h brings the system headers: none may follow the target pragma).
#pragma once

// FUSEDAMP_F16C_LANES (8 or 16, set by the AVX2 / AVX-512 builds on x86-64): the width of the
// hand-written vector code, fp16 converted with the hardware instructions instead of the bit-level
// code of math/dtypes.h. 0 (the baseline build, other CPUs): the element loops of math/ alone.
#ifndef FUSEDAMP_F16C_LANES
#define FUSEDAMP_F16C_LANES 0
#endif

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// Each operation is one or a few instructions, always_inline: the codec's loops are made of them.
#if FUSEDAMP_F16C_LANES == 16
// AVX-512. The maskz forms (all lanes kept), as in cpu/staging.h: the plain ones trip a
// -Wmaybe-uninitialized false positive in gcc 12.
constexpr int64_t kCodeLanes = 16;
using CodeLanes = __m512i;
[[gnu::always_inline]] inline CodeLanes load_code_lanes(const uint8_t* codes) {
  return _mm512_maskz_cvtepu8_epi32(__mmask16(0xffff), _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
[[gnu::always_inline]] inline CodeLanes load_signed_code_lanes(const uint8_t* codes) {
  return _mm512_maskz_cvtepi8_epi32(__mmask16(0xffff), _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
}
// (A vector at a time: packing two vectors to bytes with shuffles, as on AVX2, made the coded
// steps slower.)
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
[[gnu::always_inline]] inline bool any_lane(LaneMask m) { return m != 0; }
[[gnu::always_inline]] inline LaneMask both(LaneMask a, LaneMask b) { return a & b; }
[[gnu::always_inline]] inline CodeLanes shift_right(CodeLanes a, int bits) {
  return _mm512_maskz_srli_epi32(__mmask16(0xffff), a, bits);
}
[[gnu::always_inline]] inline CodeLanes shift_left(CodeLanes a, int bits) {
  return _mm512_maskz_slli_epi32(__mmask16(0xffff), a, bits);
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
// The sum of the lanes (as 32-bit integers, wrapping).
[[gnu::always_inline]] inline uint32_t sum_of_lanes(CodeLanes a) {
  const __m256i half = _mm256_add_epi32(_mm512_maskz_extracti64x4_epi64(__mmask8(0xff), a, 0),
                                        _mm512_maskz_extracti64x4_epi64(__mmask8(0xff), a, 1));
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
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
// The lanes as fp32 values (bit patterns in and out): a product, a sum, a conversion from
// integers and one to integers (truncated).
[[gnu::always_inline]] inline CodeLanes mul_float_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
}
[[gnu::always_inline]] inline CodeLanes add_float_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
}
[[gnu::always_inline]] inline CodeLanes integer_lanes_as_floats(CodeLanes a) {
  return _mm512_castps_si512(_mm512_maskz_cvtepi32_ps(__mmask16(0xffff), a));
}
[[gnu::always_inline]] inline CodeLanes float_lanes_as_integers(CodeLanes a) {
  return _mm512_maskz_cvttps_epi32(__mmask16(0xffff), _mm512_castsi512_ps(a));
}
// Shifts by a count known at run time only, the same for every lane.
using ShiftCount = __m128i;
[[gnu::always_inline]] inline ShiftCount shift_count(uint32_t bits) { return _mm_cvtsi32_si128(int(bits)); }
[[gnu::always_inline]] inline CodeLanes shift_right_by(CodeLanes a, ShiftCount count) {
  return _mm512_maskz_srl_epi32(__mmask16(0xffff), a, count);
}
[[gnu::always_inline]] inline CodeLanes shift_left_by(CodeLanes a, ShiftCount count) {
  return _mm512_maskz_sll_epi32(__mmask16(0xffff), a, count);
}
// (a & mask) | bits, one instruction.
[[gnu::always_inline]] inline CodeLanes and_or(CodeLanes a, uint32_t mask, uint32_t bits) {
  return _mm512_ternarylogic_epi32(a, lanes_of(mask), lanes_of(bits), 0xea);
}
[[gnu::always_inline]] inline void store_bit_lanes(float* values, CodeLanes a) {
  _mm512_storeu_ps(values, _mm512_castsi512_ps(a));
}
[[gnu::always_inline]] inline CodeLanes load_word_lanes(const uint32_t* words) {
  return _mm512_loadu_si512(words);
}
[[gnu::always_inline]] inline void store_word_lanes(uint32_t* words, CodeLanes a) { _mm512_storeu_si512(words, a); }
[[gnu::always_inline]] inline CodeLanes xor_lanes(CodeLanes a, CodeLanes b) { return _mm512_xor_si512(a, b); }
[[gnu::always_inline]] inline LaneMask lanes_below_lanes(CodeLanes a, CodeLanes b) {
  return _mm512_cmplt_epi32_mask(a, b);
}
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
// `codes` where `values` is not 0, else 0.
[[gnu::always_inline]] inline CodeLanes zero_where_zero(CodeLanes codes, CodeLanes values) {
  return keep_lanes(lanes_nonzero(values), codes);
}
// max(codes, least) where `values` is not 0, else 0: one instruction after the test.
[[gnu::always_inline]] inline CodeLanes at_least_or_zero(CodeLanes codes, CodeLanes least, CodeLanes values) {
  return _mm512_maskz_max_epi32(lanes_nonzero(values), codes, least);
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
// Every lane of a mask is all ones or all zeros, so its sign bits tell (vmovmskps is one
// instruction, vptest two).
[[gnu::always_inline]] inline bool any_lane(LaneMask m) { return _mm256_movemask_ps(_mm256_castsi256_ps(m)) != 0; }
[[gnu::always_inline]] inline LaneMask both(LaneMask a, LaneMask b) { return _mm256_and_si256(a, b); }
[[gnu::always_inline]] inline CodeLanes shift_right(CodeLanes a, int bits) { return _mm256_srli_epi32(a, bits); }
[[gnu::always_inline]] inline CodeLanes shift_left(CodeLanes a, int bits) { return _mm256_slli_epi32(a, bits); }
[[gnu::always_inline]] inline CodeLanes or_masked(CodeLanes a, CodeLanes b, uint32_t mask) {
  return _mm256_or_si256(a, _mm256_and_si256(b, lanes_of(mask)));
}
[[gnu::always_inline]] inline CodeLanes add_lanes(CodeLanes a, CodeLanes b) { return _mm256_add_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes sub_lanes(CodeLanes a, CodeLanes b) { return _mm256_sub_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes and_lanes(CodeLanes a, CodeLanes b) { return _mm256_and_si256(a, b); }
[[gnu::always_inline]] inline CodeLanes min_lanes(CodeLanes a, CodeLanes b) { return _mm256_min_epi32(a, b); }
[[gnu::always_inline]] inline CodeLanes max_unsigned_lanes(CodeLanes a, CodeLanes b) { return _mm256_max_epu32(a, b); }
[[gnu::always_inline]] inline uint32_t sum_of_lanes(CodeLanes a) {
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
}
[[gnu::always_inline]] inline uint32_t max_unsigned_of_lanes(CodeLanes a) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(m));
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
[[gnu::always_inline]] inline CodeLanes mul_float_lanes(CodeLanes a, CodeLanes b) {
  return _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)));
}
[[gnu::always_inline]] inline CodeLanes add_float_lanes(CodeLanes a, CodeLanes b) {
  return _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b)));
}
[[gnu::always_inline]] inline CodeLanes integer_lanes_as_floats(CodeLanes a) {
  return _mm256_castps_si256(_mm256_cvtepi32_ps(a));
}
[[gnu::always_inline]] inline CodeLanes float_lanes_as_integers(CodeLanes a) {
  return _mm256_cvttps_epi32(_mm256_castsi256_ps(a));
}
// Shifts by a count known at run time only, the same for every lane: by a vector of counts
// (vpsrlvd is one instruction on Intel's cores since Skylake, a shift by an xmm count two).
using ShiftCount = __m256i;
[[gnu::always_inline]] inline ShiftCount shift_count(uint32_t bits) { return lanes_of(bits); }
[[gnu::always_inline]] inline CodeLanes shift_right_by(CodeLanes a, ShiftCount count) {
  return _mm256_srlv_epi32(a, count);
}
[[gnu::always_inline]] inline CodeLanes shift_left_by(CodeLanes a, ShiftCount count) {
  return _mm256_sllv_epi32(a, count);
}
[[gnu::always_inline]] inline CodeLanes and_or(CodeLanes a, uint32_t mask, uint32_t bits) {
  return _mm256_or_si256(_mm256_and_si256(a, lanes_of(mask)), lanes_of(bits));
}
[[gnu::always_inline]] inline void store_bit_lanes(float* values, CodeLanes a) {
  _mm256_storeu_ps(values, _mm256_castsi256_ps(a));
}
[[gnu::always_inline]] inline CodeLanes load_word_lanes(const uint32_t* words) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words));
}
[[gnu::always_inline]] inline void store_word_lanes(uint32_t* words, CodeLanes a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), a);
}
[[gnu::always_inline]] inline CodeLanes xor_lanes(CodeLanes a, CodeLanes b) { return _mm256_xor_si256(a, b); }
[[gnu::always_inline]] inline LaneMask lanes_below_lanes(CodeLanes a, CodeLanes b) { return _mm256_cmpgt_epi32(b, a); }
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
// `codes` where `values` is not 0, else 0: an andnot with the zero lanes, one instruction fewer
// than a mask of the others.
[[gnu::always_inline]] inline CodeLanes zero_where_zero(CodeLanes codes, CodeLanes values) {
  return _mm256_andnot_si256(_mm256_cmpeq_epi32(values, _mm256_setzero_si256()), codes);
}
// max(codes, least) where `values` is not 0, else 0.
[[gnu::always_inline]] inline CodeLanes at_least_or_zero(CodeLanes codes, CodeLanes least, CodeLanes values) {
  return zero_where_zero(_mm256_max_epi32(codes, least), values);
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

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

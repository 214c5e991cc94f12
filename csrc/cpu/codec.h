// The vector codec of the CPU kernel builds, in codec blocks and vectors: math/codec.h's optimizer
// state codecs a vector at a time ([note: vector codes]), the twin of cuda/codec.cuh. A codec
// block's top exponent (MagnitudeMax, block_top_of) and its codes (encode_codes, decode_state_tile,
// whole blocks: encode_state_tile), bf16 states rounded stochastically, and the random bits both
// take, bitwise those of the element functions. Included by the cpu/ headers and
// csrc/cpu/kernels/*.cpp only, after their ISA preamble.
#pragma once

#include "cpu/lanes.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// [note: vector codes] codec.h's encode_code and decode_code, a vector at a time: the same integer
// steps on the fp32 bit patterns (in the lanes of cpu/lanes.h), so the codes are bitwise those of
// the element functions (which the baseline build and each tile's tail use). g++ vectorized the
// element loops into 64-lane byte shuffles with register spills: the int8 AdamW step took twice
// the fp32-moment one.

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


// float_to_bf16_state a vector at a time: the bf16 bits in the low half of each lane.
[[gnu::always_inline]] inline CodeLanes bf16_state_lanes(CodeLanes bits, CodeLanes random) {
  CodeLanes result = shift_right(add_lanes(bits, and_lanes(random, lanes_of(0xffffu))), 16);
  const LaneMask nan = lanes_at_least(and_lanes(bits, lanes_of(0x7fffffffu)), 0x7f800001u);
  if (any_lane(nan)) result = select_lanes(nan, lanes_of(0x7fc0u), result);
  return result;
}
#endif

// Where the stochastic roundings of a run of values take their draws (value i's, element or a
// vector from it): the keyed hash of each element (rounding_bits), plus the step's rotation when
// the stream's draws are dithered ([note: dithered draws]); or a tile of draws made once by
// fill_draws for the states that share them ([note: shared state draws]).
template <bool kDithered = false>
struct KeyedDraws {
  uint32_t key;
  int64_t first_element;  // value 0's
  uint32_t rotation = 0;  // kDithered only

  [[gnu::always_inline]] uint32_t element(int64_t i) const {
    const uint32_t bits = rounding_bits(key, first_element + i);
    return kDithered ? bits + rotation : bits;
  }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const {
    const CodeLanes elements = add_lanes(lanes_of(uint32_t(first_element + i)), lane_indices());
    const CodeLanes bits = rounding_bit_lanes(key, elements);
    return kDithered ? add_lanes(bits, lanes_of(rotation)) : bits;
  }
#endif
};

struct TiledDraws {
  const uint32_t* draws;  // value 0's

  [[gnu::always_inline]] uint32_t element(int64_t i) const { return draws[i]; }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const { return load_word_lanes(draws + i); }
#endif
};

// The first n draws of `keyed`.
template <bool kDithered>
[[gnu::always_inline]] inline void fill_draws(const KeyedDraws<kDithered>& keyed, int64_t n, uint32_t* draws) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  for (; i + kCodeLanes <= n; i += kCodeLanes) store_word_lanes(draws + i, keyed.lanes(i));
#endif
  for (; i < n; ++i) draws[i] = keyed.element(i);
}

// What encode_code's rounding adds to each value: half a step, or share S of its draw
// (stochastic_code_rounding).
struct NearestCodeRounding {
  [[gnu::always_inline]] uint32_t element(int64_t) const { return kNearestCodeRounding; }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t) const { return lanes_of(kNearestCodeRounding); }
#endif
};

template <DrawShare S, typename Draws>
struct StochasticCodeRounding {
  Draws draws;

  [[gnu::always_inline]] uint32_t element(int64_t i) const { return stochastic_code_rounding<S>(draws.element(i)); }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const {
    const CodeLanes random = draws.lanes(i);
    if constexpr (S == DrawShare::kLow) {
      return or_masked(lanes_of(0x80u), shift_left(random, 8), 0xfff00u);
    } else {
      return shift_right(random, 12);
    }
  }
#endif
};

template <DrawShare S, typename Draws>
[[gnu::always_inline]] inline StochasticCodeRounding<S, Draws> stochastic_code_rounding_of(Draws draws) {
  return {draws};
}

// fp32 values to a bf16 state, rounded stochastically with share S of their draws
// ([note: unbiased state rounding]).
template <DrawShare S, typename Draws>
[[gnu::always_inline]] inline void float_tile_to_bf16_state(const float* src, uint16_t* dst, int64_t n,
                                                            Draws draws) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  for (; i + kCodeLanes <= n; i += kCodeLanes) {
    const CodeLanes random = draws.lanes(i);
    store_half_lanes(dst + i, bf16_state_lanes(load_bit_lanes(src + i),
                                               S == DrawShare::kHigh ? shift_right(random, 16) : random));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_bf16_state(src[i], bf16_state_random<S>(draws.element(i)));
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
// rounded by its lane of `rounding` (the lanes of NearestCodeRounding or StochasticCodeRounding).
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
// encode_code_lanes over the whole vectors of n values, rounded by `rounding`
// (NearestCodeRounding, StochasticCodeRounding); returns how many values they took.
template <bool kSigned, EncodeForm kForm, typename Rounding>
[[gnu::always_inline]] inline int64_t encode_code_vectors(const float* values, int64_t n, uint32_t top,
                                                          uint8_t* codes, const Rounding& rounding) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 8
  for (; i + 2 * kCodeLanes <= n; i += 2 * kCodeLanes) {
    const CodeVector a = encode_code_lanes<kSigned, kForm>(values + i, top, rounding.lanes(i));
    const CodeVector b =
        encode_code_lanes<kSigned, kForm>(values + i + kCodeLanes, top, rounding.lanes(i + kCodeLanes));
    store_code_lane_pair(codes + i, keep_lanes(a.kept, a.codes), keep_lanes(b.kept, b.codes));
  }
#endif
  for (; i + kCodeLanes <= n; i += kCodeLanes) {
    store_code_vector(codes + i, encode_code_lanes<kSigned, kForm>(values + i, top, rounding.lanes(i)));
  }
  return i;
}
#endif

// The codes of n values of a block, rounded by `rounding` (NearestCodeRounding,
// StochasticCodeRounding).
template <bool kSigned, typename Rounding>
[[gnu::always_inline]] inline void encode_codes(const float* values, int64_t n, BlockTop top, uint8_t* codes,
                                                const Rounding& rounding) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  if (top.exponent > uint32_t(BlockCode<kSigned>::kTopExponent)) {
    if (top.plain && top.exponent < 254u) {
      i = encode_code_vectors<kSigned, EncodeForm::kFiniteNormal>(values, n, top.exponent, codes, rounding);
    } else {
      i = encode_code_vectors<kSigned, EncodeForm::kNormal>(values, n, top.exponent, codes, rounding);
    }
  } else {
    i = encode_code_vectors<kSigned, EncodeForm::kGeneral>(values, n, top.exponent, codes, rounding);
  }
#endif
  for (; i < n; ++i) codes[i] = encode_code<kSigned>(values[i], top.exponent, rounding.element(i));
}

// A whole block (n <= kCodecBlock values) to codes and its scale.
template <bool kSigned>
[[gnu::always_inline]] inline void encode_state_tile(const float* values, int64_t n, uint8_t* codes, float* scale) {
  MagnitudeMax<kSigned> largest;
  largest.fold(values, n);
  const BlockTop top = block_top_of(values, n, largest.bits(), kNearestCodeRounding);
  encode_codes<kSigned>(values, n, top, codes, NearestCodeRounding{});
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

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

// The vector codec of the CPU kernel builds, in codec blocks and vectors: math/codec.h's optimizer
// state codecs a vector at a time ([note: vector codes]), the twin of cuda/codec.cuh. A codec
// block's scale and form (BlockStats, block_scale_of) and its codes (encode_codes,
// decode_state_tile, whole blocks: encode_state_tile), bf16 states rounded stochastically, and the
// random bits both take, bitwise those of the element functions. Included by the cpu/ headers and
// csrc/cpu/kernels/*.cpp only, after their ISA preamble.
#pragma once

#include "cpu/lanes.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// [note: vector codes] codec.h's encode_code and decode_code, a vector at a time: the same integer
// and fp32 operations (in the lanes of cpu/lanes.h, each rounded as the element functions' are:
// the build contracts nothing into FMAs), so the codes are bitwise those of the element functions
// (which the baseline build and each tile's tail use). g++ vectorized the
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
// vector from it): every coded state's draws are dithered ([note: dithered draws]), each
// element's phase (dither_phase) plus the step's rotation: from the stream's key for any run
// (DitheredDraws), from a block's phases made once (PhasedDraws, [note: block phases]), or a tile
// of draws made once by fill_draws for the states that share them (TiledDraws, [note: shared
// state draws]).
struct DitheredDraws {
  uint32_t key;           // the stream's dither key (ChunkKeys::dither_key)
  int64_t first_element;  // value 0's
  uint32_t rotation;      // the step's (ChunkKeys::rotation)

  [[gnu::always_inline]] uint32_t element(int64_t i) const { return dither_phase(key, first_element + i) + rotation; }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const {
    const int64_t first = first_element + i;
    // A vector that starts at a multiple of its width lies in one group ([note: dither phases]):
    // one hash for all its lanes, each adding its dither_lane_offset.
    const CodeLanes lane_steps = mul_lanes(lane_indices(), kDitherLaneStep);
    if (first % kCodeLanes == 0) {
      return add_lanes(lanes_of(dither_phase(key, first) + rotation), lane_steps);
    }
    static_assert(kDitherGroup == 16 && kDitherGroup % kCodeLanes == 0, "a vector spans at most two groups");
    const CodeLanes places = add_lanes(lanes_of(uint32_t(first % kDitherGroup)), lane_indices());
    const CodeLanes groups = add_lanes(lanes_of(uint32_t(first / kDitherGroup)), shift_right(places, 4));
    const CodeLanes offsets = mul_lanes(and_lanes(places, lanes_of(uint32_t(kDitherGroup - 1))), kDitherLaneStep);
    return add_lanes(add_lanes(rounding_bit_lanes(key, groups), offsets), lanes_of(rotation));
  }
#endif
};

// [note: block phases] A codec block's draws from its groups' phases, made once for the block:
// the hashes of its kBlockPhases groups (dither_group_bits) plus the step's rotation, one vector
// hash per kCodeLanes groups (fill_block_phases), where each vector of codes took a scalar hash of
// its own (about fifteen scalar instructions in the coded steps' busiest loop). PhasedDraws reads
// them: `first` is value 0's element in the block, and a vector (lanes) starts at a multiple of
// kCodeLanes from the block's first element, so that it lies in one group.
constexpr int64_t kBlockPhases = kCodecBlock / kDitherGroup;

[[gnu::always_inline]] inline void fill_block_phases(uint32_t key, int64_t block_first, uint32_t rotation,
                                                     uint32_t* phases) {
  int64_t g = 0;
#if FUSEDAMP_F16C_LANES
  static_assert(kBlockPhases % kCodeLanes == 0, "whole vectors of phases");
  for (; g < kBlockPhases; g += kCodeLanes) {
    const CodeLanes groups = add_lanes(lanes_of(uint32_t(block_first / kDitherGroup + g)), lane_indices());
    store_word_lanes(phases + g, add_lanes(rounding_bit_lanes(key, groups), lanes_of(rotation)));
  }
#endif
  for (; g < kBlockPhases; ++g) phases[g] = dither_group_bits(key, block_first + g * kDitherGroup) + rotation;
}

struct PhasedDraws {
  const uint32_t* phases;  // the block's (fill_block_phases)
  int64_t first;           // value 0's element in the block

  [[gnu::always_inline]] uint32_t element(int64_t i) const {
    const int64_t place = first + i;
    return phases[place / kDitherGroup] + dither_lane_offset(uint32_t(place % kDitherGroup));
  }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const {
    const CodeLanes lane_steps = mul_lanes(lane_indices(), kDitherLaneStep);
    if constexpr (kCodeLanes == kDitherGroup) {
      return add_lanes(lanes_of(phases[(first + i) / kDitherGroup]), lane_steps);
    } else {
      return add_lanes(lanes_of(element(i)), lane_steps);
    }
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
template <typename Draws>
[[gnu::always_inline]] inline void fill_draws(const Draws& keyed, int64_t n, uint32_t* draws) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  for (; i + kCodeLanes <= n; i += kCodeLanes) store_word_lanes(draws + i, keyed.lanes(i));
#endif
  for (; i < n; ++i) draws[i] = keyed.element(i);
}

// The units ([note: unbiased state rounding] in math/codec.h) encode_code rounds each value with:
// to nearest, or from share S of its draw (stochastic_code_unit).
struct NearestCodeRounding {
  [[gnu::always_inline]] uint32_t element(int64_t) const { return kNearestCodeUnit; }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t) const { return lanes_of(kNearestCodeUnit); }
#endif
};

template <DrawShare S, typename Draws>
struct StochasticCodeRounding {
  Draws draws;

  [[gnu::always_inline]] uint32_t element(int64_t i) const { return stochastic_code_unit<S>(draws.element(i)); }
#if FUSEDAMP_F16C_LANES
  [[gnu::always_inline]] CodeLanes lanes(int64_t i) const {
    const CodeLanes random = draws.lanes(i);
    if constexpr (S == DrawShare::kLow) {
      return and_or(shift_left(random, 11), 0x7ff800u, 0x3f800400u);
    } else {
      return and_or(shift_right(random, 9), 0x7ffff8u, 0x3f800004u);
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

// What a block's codes are chosen from, folded in a group of values at a time: the running
// maximum of the values' magnitude bits (non-finite ones included) and, in a signed state, the sum
// of their exponents (block_is_wide). An unsigned state's maximum is taken over the raw bits: its
// values are not negative, and one with its sign bit set (a -0 or a NaN) makes the block not plain
// (BlockScale), so block_scale_of looks again; that saves the mask in the busiest loop.
// (Its members are set by reset(): an implicit constructor would miss the build's target pragma.)
template <bool kSigned>
struct BlockStats {
  static constexpr uint32_t kMask = kSigned ? 0x7fffffffu : 0xffffffffu;

#if FUSEDAMP_F16C_LANES
  CodeLanes max_lanes;
  CodeLanes exponent_lanes;
#endif
  uint32_t max_rest;
  uint32_t exponent_rest;

  [[gnu::always_inline]] BlockStats() { reset(); }

  [[gnu::always_inline]] void reset() {
#if FUSEDAMP_F16C_LANES
    max_lanes = lanes_of(0);
    exponent_lanes = lanes_of(0);
#endif
    max_rest = 0;
    exponent_rest = 0;
  }

  [[gnu::always_inline]] void fold(const float* values, int64_t n) {
    int64_t i = 0;
#if FUSEDAMP_F16C_LANES
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      const CodeLanes bits = load_bit_lanes(values + i);
      const CodeLanes magnitude = kSigned ? and_lanes(bits, lanes_of(kMask)) : bits;
      max_lanes = max_unsigned_lanes(max_lanes, magnitude);
      if constexpr (kSigned) exponent_lanes = add_lanes(exponent_lanes, shift_right(magnitude, 23));
    }
#endif
    for (; i < n; ++i) {
      const uint32_t magnitude = float_bits(values[i]) & kMask;
      max_rest = std::max(max_rest, magnitude);
      if constexpr (kSigned) exponent_rest += magnitude_exponent(magnitude);
    }
  }

  [[gnu::always_inline]] uint32_t max_bits() const {
#if FUSEDAMP_F16C_LANES
    return std::max(max_unsigned_of_lanes(max_lanes), max_rest);
#else
    return max_rest;
#endif
  }

  [[gnu::always_inline]] uint32_t exponent_sum() const {
#if FUSEDAMP_F16C_LANES
    return sum_of_lanes(exponent_lanes) + exponent_rest;
#else
    return exponent_rest;
#endif
  }
};

// How a block's values are encoded: its stored scale (with the form), what encoding needs of it,
// and whether every value is plain: finite, in an unsigned state also without its sign bit, and
// at most the top code's value relative to the scale (the vector encoder then clamps nothing; a
// scale rounded to the largest value's own quotient, or at the bf16 maximum, can leave it above).
struct BlockScale {
  uint16_t stored;
  BlockEncoding encoding;
  bool plain;
};

// The BlockScale of a block of n (1 <= n <= kCodecBlock) values whose BlockStats are `stats`: its
// largest finite magnitude (only a block that holds a value that is not plain looks again for it)
// and its form ([note: block codes]); `previous`: the scale the block had (0: none), kept while it
// fits ([note: steady scales]).
template <bool kSigned>
[[gnu::always_inline]] inline BlockScale block_scale_of(const float* values, int64_t n, const BlockStats<kSigned>& stats,
                                                        uint16_t previous = 0) {
  uint32_t max_bits = stats.max_bits();
  const bool plain = max_bits < 0x7f800000u;
  if (!plain) {
    max_bits = 0;
    for (int64_t i = 0; i < n; ++i) max_bits = std::max(max_bits, finite_magnitude_bits(values[i]));
  }
  const bool wide = block_is_wide<kSigned>(max_bits, stats.exponent_sum(), uint32_t(n), scale_is_wide(previous));
  const uint16_t stored = block_scale_bits<kSigned>(max_bits, wide, previous);
  const BlockEncoding encoding = block_encoding(stored);
  const bool under_top = float_bits(float_from_bits(max_bits) * encoding.inverse) <= code_form<kSigned>(wide).top_bits;
  return {stored, encoding, plain && under_top};
}

// A kind's forms by `wide`, in memory: the vector codec's constants of a block are then loads of
// the form's fields, where picking each from two took scalar instructions and a broadcast.
template <bool kSigned>
inline constexpr CodeForm kCodeForms[2] = {narrow_code_form<kSigned>(), wide_code_form<kSigned>()};

#if FUSEDAMP_F16C_LANES
// A block's encode_code constants in lanes: its form's and the inverse of its scale.
struct EncodeLanes {
  CodeLanes inverse;          // as float bits
  CodeLanes real_code_offset;
  CodeLanes smallest_bits;
  CodeLanes top_bits;
  CodeLanes code_base;        // offset + 1: what the unit in [1, 2) and the offset add to a code
  CodeLanes smallest_code;
  CodeLanes below_multiplier;  // signed: 1 / rel(smallest code), a power of two, as float bits
  ShiftCount shift;
};

template <bool kSigned>
[[gnu::always_inline]] inline EncodeLanes encode_lanes_of(BlockEncoding encoding) {
  const CodeForm& form = kCodeForms<kSigned>[encoding.wide];
  return {lanes_of(float_bits(encoding.inverse)),
          lanes_of(form.real_code_offset),
          lanes_of(form.smallest_bits),
          lanes_of(form.top_bits),
          lanes_of(form.offset + 1u),
          lanes_of(form.smallest_code),
          lanes_of((254u << 23) - form.smallest_bits),
          shift_count(form.shift)};
}

// encode_code on the next kCodeLanes values of a block, each rounded with its lane of `unit`
// (the lanes of NearestCodeRounding or StochasticCodeRounding). kPlain: every value of the block
// is plain (BlockScale), so no lane needs the non-finite codes or the clamp at the top code, and an
// unsigned state's bits are its magnitudes.
template <bool kSigned, bool kPlain>
[[gnu::always_inline]] inline CodeLanes encode_code_lanes(const float* values, const EncodeLanes& block,
                                                          CodeLanes unit) {
  using Code = BlockCode<kSigned>;
  const CodeLanes bits = load_bit_lanes(values);
  const CodeLanes magnitude = !kSigned && kPlain ? bits : and_lanes(bits, lanes_of(0x7fffffffu));
  // encode_code's steps; every value compared is below 2^31, so signed compares order the bits.
  // Without the lower clamp: the code of a lane below the smallest code is replaced below, and
  // its real code is still a normal float in every form (real_code_offset alone is a normal
  // float's bits, and the shifted position only adds to them: no denormal, no microcode assist).
  const CodeLanes relative = mul_float_lanes(magnitude, block.inverse);
  const CodeLanes position = kPlain ? relative : min_lanes(relative, block.top_bits);
  const CodeLanes real_code = add_lanes(shift_right_by(position, block.shift), block.real_code_offset);
  CodeLanes code = sub_lanes(float_lanes_as_integers(add_float_lanes(real_code, unit)), block.code_base);
  if constexpr (!kSigned && kPlain) {
    // A lane below the smallest code rounds to at most it (its position and real code are
    // smaller, so is the sum), so the smallest code is its code: a maximum instead of a test; a
    // zero stays 0.
    return at_least_or_zero(code, block.smallest_code, magnitude);
  } else {
    const LaneMask below = lanes_below_lanes(relative, block.smallest_bits);
    if (any_lane(below)) {
      if constexpr (kSigned) {
        const CodeLanes scaled = add_float_lanes(mul_float_lanes(relative, block.below_multiplier), unit);
        code = select_lanes(below, keep_lanes(lanes_at_least(scaled, 0x40000000u), block.smallest_code), code);
      } else {
        code = select_lanes(below, block.smallest_code, code);
      }
    }
  }
  if constexpr (kSigned) code = or_masked(code, shift_right(bits, 24), 0x80u);
  if constexpr (!kPlain) {
    const LaneMask non_finite = lanes_at_least(magnitude, 0x7f800000u);
    if (any_lane(non_finite)) {
      // An inf keeps its sign, a NaN is the one unsigned NaN code (encode_code).
      CodeLanes inf = lanes_of(Code::kInf);
      if constexpr (kSigned) inf = or_masked(inf, shift_right(bits, 24), 0x80u);
      const CodeLanes special = select_lanes(lanes_equal(magnitude, 0x7f800000u), inf, lanes_of(Code::kNan));
      code = select_lanes(non_finite, special, code);
    }
  }
  // A zero stays 0 in an unsigned state; a signed one keeps its sign.
  if constexpr (!kSigned) code = zero_where_zero(code, magnitude);
  return code;
}

// decode_code on the next kCodeLanes codes of a block, as fp32 bit patterns. kSpecialCodes: some
// code of the block may be zero, NaN or inf, so the lanes are checked for them.
struct DecodeLanes {
  CodeLanes scale;  // as float bits
  CodeLanes bias;
  ShiftCount shift;
};

template <bool kSigned, bool kSpecialCodes>
[[gnu::always_inline]] inline CodeLanes decode_code_lanes(const uint8_t* codes, const DecodeLanes& block) {
  using Code = BlockCode<kSigned>;
  constexpr uint32_t kOffset = narrow_code_form<kSigned>().offset;
  // A signed code sign-extended: its sign is already in the lane's sign bit.
  const CodeLanes code = kSigned ? load_signed_code_lanes(codes) : load_code_lanes(codes);
  const CodeLanes magnitude = kSigned ? and_lanes(code, lanes_of(Code::kMagnitudeMask)) : code;
  const CodeLanes integer = integer_lanes_as_floats(kOffset == 0 ? magnitude : add_lanes(magnitude, lanes_of(kOffset)));
  CodeLanes result = mul_float_lanes(add_lanes(shift_left_by(integer, block.shift), block.bias), block.scale);
  if constexpr (kSigned) result = or_masked(result, code, 0x80000000u);
  if constexpr (kSpecialCodes) {
    const LaneMask special = lanes_below(magnitude, Code::kInf + 1u);
    if (any_lane(special)) {
      const CodeLanes nan_or_inf =
          select_lanes(lanes_equal(magnitude, Code::kNan), lanes_of(0x7fc00000u), lanes_of(0x7f800000u));
      CodeLanes value = select_lanes(lanes_equal(magnitude, Code::kZero), lanes_of(0), nan_or_inf);
      if constexpr (kSigned) value = or_masked(value, code, 0x80000000u);
      result = select_lanes(special, value, result);
    }
  }
  return result;
}
#endif

// How the vector decoders take a block's codes.
struct BlockDecode {
  uint16_t stored;     // the block's scale, with its form
  bool special_codes;  // some code may be zero, NaN or inf: each vector is checked
};

// The BlockDecode of a block's n codes of this stored scale. The block is scanned once for the
// codes of zero, NaN and inf, so that its vectors need no check when it has none (a moment's
// blocks seldom have any: 2 instructions fewer per vector and state).
template <bool kSigned>
[[gnu::always_inline]] inline BlockDecode block_decode_of(const uint8_t* codes, uint16_t stored, int64_t n) {
  bool special_codes = true;
#if FUSEDAMP_F16C_LANES
  // Codes 0 to 3 (3 is a value, which the check leaves as it is) have none of the bits above 3.
  special_codes = any_code_without(codes, n, uint8_t(BlockCode<kSigned>::kMagnitudeMask & ~3u));
#endif
  return {stored, special_codes};
}

#if FUSEDAMP_F16C_LANES
// encode_code_lanes over the whole vectors of n values, rounded by `rounding`
// (NearestCodeRounding, StochasticCodeRounding); returns how many values they took.
template <bool kSigned, bool kPlain, typename Rounding>
[[gnu::always_inline]] inline int64_t encode_code_vectors(const float* values, int64_t n, const EncodeLanes& block,
                                                          uint8_t* codes, const Rounding& rounding) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 8
  for (; i + 2 * kCodeLanes <= n; i += 2 * kCodeLanes) {
    store_code_lane_pair(codes + i, encode_code_lanes<kSigned, kPlain>(values + i, block, rounding.lanes(i)),
                         encode_code_lanes<kSigned, kPlain>(values + i + kCodeLanes, block, rounding.lanes(i + kCodeLanes)));
  }
#endif
  for (; i + kCodeLanes <= n; i += kCodeLanes) {
    store_code_lanes(codes + i, encode_code_lanes<kSigned, kPlain>(values + i, block, rounding.lanes(i)));
  }
  return i;
}
#endif

// The codes of n values of a block, rounded by `rounding` (NearestCodeRounding,
// StochasticCodeRounding).
template <bool kSigned, typename Rounding>
[[gnu::always_inline]] inline void encode_codes(const float* values, int64_t n, const BlockScale& scale, uint8_t* codes,
                                                const Rounding& rounding) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  const EncodeLanes block = encode_lanes_of<kSigned>(scale.encoding);
  if (scale.plain) {
    i = encode_code_vectors<kSigned, true>(values, n, block, codes, rounding);
  } else {
    i = encode_code_vectors<kSigned, false>(values, n, block, codes, rounding);
  }
#endif
  for (; i < n; ++i) codes[i] = encode_code<kSigned>(values[i], scale.encoding, rounding.element(i));
}

// A whole block (n <= kCodecBlock values) to codes and its scale, rounded to nearest.
template <bool kSigned>
[[gnu::always_inline]] inline void encode_state_tile(const float* values, int64_t n, uint8_t* codes,
                                                     uint16_t* scale) {
  BlockStats<kSigned> stats;
  stats.fold(values, n);
  const BlockScale block = block_scale_of<kSigned>(values, n, stats);
  encode_codes<kSigned>(values, n, block, codes, NearestCodeRounding{});
  *scale = block.stored;
}

// n codes of a block of BlockDecode `decode` as fp32 values.
template <bool kSigned>
[[gnu::always_inline]] inline void decode_state_tile(const uint8_t* codes, BlockDecode decode, int64_t n,
                                                     float* values) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  const CodeForm& form = kCodeForms<kSigned>[scale_is_wide(decode.stored)];
  const DecodeLanes block{lanes_of(float_bits(scale_value(decode.stored))), lanes_of(form.bias),
                          shift_count(form.shift)};
  if (decode.special_codes) {
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      store_bit_lanes(values + i, decode_code_lanes<kSigned, true>(codes + i, block));
    }
  } else {
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      store_bit_lanes(values + i, decode_code_lanes<kSigned, false>(codes + i, block));
    }
  }
#endif
  for (; i < n; ++i) values[i] = decode_code<kSigned>(codes[i], decode.stored);
}

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

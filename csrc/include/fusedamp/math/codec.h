// Optimizer state codecs ([note: state codecs]): how a moment is stored (fp32, bf16, or 8-bit
// codes with one bf16 scale per block of kCodecBlock elements), loaded as fp32 and stored back,
// rounded stochastically by the optimizer steps ([note: unbiased state rounding]).
#pragma once

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// How an optimizer's per-element states (moments, momentum buffers) are stored. One codec per call.
enum class StateCodec : int32_t {
  kFloat32 = 0,   // float per element
  kBFloat16 = 1,  // bf16 per element
  kInt8 = 2,      // uint8 code per element + one bf16 scale per block ([note: block codes])
};

// Elements per scale of kInt8. Every chunk of both backends is a multiple of it, so a block
// always belongs to one chunk (one task or one CUDA block).
constexpr int64_t kCodecBlock = 256;

inline int64_t codec_blocks(int64_t numel) { return (numel + kCodecBlock - 1) / kCodecBlock; }

// [note: block codes] An 8-bit code's magnitude c (7 bits under a sign for signed states: exp_avg,
// momentum; 8 bits for unsigned ones: exp_avg_sq, max_exp_avg_sq) stands for rel(c) * scale, where
// scale is its block's and
//
//     rel(c) = float_from_bits((float_bits(float(c + offset)) << shift) + bias)
//
// The integer c + offset read as a float holds, under its leading one, `shift` bits that the shift
// moves into the exponent field and the rest as mantissa: the codes [2^p, 2^(p + 1)) - offset cover
// 2^shift binades with 2^(p - shift) codes each. So the top binade ([0.5, 1) of the scale) gets
// the most mantissa bits, and each region of 2^shift binades below it one bit fewer, down to a
// binade a code: the precision tapers away from the block's largest value, as bitsandbytes'
// dynamic map does (in decades, with a lookup table), with a range of 11 to 24 binades. Between two
// neighbouring codes the value is linear in c (binade edges fall on codes), so encoding inverts
// the map exactly: shift the value's bits back and read the float as the real-valued position c,
// whose fraction is the stochastic rounding's probability of rounding up. Both directions are a
// few integer and float operations, no table, no search, so they vectorize on AVX2 and give the
// same bits on every ISA build and on CUDA. The top bits that decoding shifts out are the
// same for every code of a form, and the bias has no bits under the exponent field, so encoding
// adds one constant to the shifted-back position (real_code_offset): one integer operation where
// undoing the bias and restoring those bits take two.
//
// Each block picks the form of its codes from its values: a signed state's block whose values lie
// on average more than kWideBinades binades below its largest (a heavy-tailed block: an update's
// error is then in its many small values) takes the wide form (shift 2: 4 mantissa bits at the
// top, 20 binades), any other the narrow one (shift 1: 5 mantissa bits in the top two binades,
// 11 binades), whose precision at the top is what a Gaussian-like block needs. Unsigned states
// have one form (shift 3, offset 32: 5 mantissa bits at the top, 24 binades; their values span
// the squares' range). The form travels in the sign bit of the block's bf16 scale.
//
// The scale is the block's largest finite magnitude over the form's top value, rounded up to bf16,
// so the top code sits at the largest value; an optimizer step keeps a block's scale while it
// still fits ([note: steady scales]). Codes 0, 1 and 2 are zero, NaN and inf (sign in the
// sign bit), so a non-finite moment stays what torch would hold instead of poisoning its block.
// Values below the smallest code round stochastically between it and 0 in signed states; in
// unsigned states a nonzero value keeps at least the smallest code, so that a second moment never
// turns into 0 under a nonzero first moment (that would divide the update by eps alone). A block
// without a finite magnitude of at least FLT_MIN stores scale 0 (its values decode as zeros).
struct CodeForm {
  uint32_t offset;         // added to a code before it is read as a float
  uint32_t shift;          // bits moved from its float's mantissa into the exponent
  uint32_t bias;           // added to the shifted bits: puts the top code into [0.5, 1)
  uint32_t real_code_offset;  // float_bits(float(c + offset)) - (float_bits(rel(c)) >> shift)
  uint32_t smallest_code;  // the least code of a value (below: zero, NaN and inf)
  uint32_t smallest_bits;  // the float bits of rel(smallest_code)
  uint32_t top_bits;       // the float bits of rel(top code), in [0.5, 1)
};

// The float bits of the integer n (1 <= n < 2^24), computed without a float: a constant expression.
constexpr uint32_t integer_float_bits(uint32_t n) {
  uint32_t power = 0;
  while ((n >> (power + 1)) != 0u) ++power;
  return ((127u + power) << 23) | ((n - (1u << power)) << (23u - power));
}

constexpr uint32_t form_bits(uint32_t code, uint32_t offset, uint32_t shift, uint32_t bias) {
  return (integer_float_bits(code + offset) << shift) + bias;
}

constexpr CodeForm make_code_form(uint32_t top_code, uint32_t offset, uint32_t shift) {
  // rel(top) in [0.5, 1): the shifted bits' exponent field rebased to 126.
  const uint32_t bias = (126u << 23) - ((integer_float_bits(top_code + offset) << shift) & 0xff800000u);
  // Codes below 2^shift - offset have fewer bits under their leading one than the shift takes.
  const uint32_t smallest = (1u << shift) > offset + 3u ? (1u << shift) - offset : 3u;
  const uint32_t smallest_bits = form_bits(smallest, offset, shift, bias);
  return {offset,
          shift,
          bias,
          integer_float_bits(smallest + offset) - (smallest_bits >> shift),
          smallest,
          smallest_bits,
          form_bits(top_code, offset, shift, bias)};
}

// Whether real_code_offset inverts a form from its smallest to its top code: true at both ends
// is enough, since both sides grow with the position and neither wraps in between.
constexpr bool real_code_offset_inverts(const CodeForm& form, uint32_t top_code) {
  const auto real_code_bits = [&](uint32_t position) { return (position >> form.shift) + form.real_code_offset; };
  return real_code_bits(form.smallest_bits) == integer_float_bits(form.smallest_code + form.offset) &&
         real_code_bits(form.top_bits) == integer_float_bits(top_code + form.offset);
}

// The code kinds: signed (sign bit + 7 bits of magnitude) and unsigned (8 bits).
template <bool kSigned>
struct BlockCode {
  static constexpr uint32_t kMagnitudeMask = kSigned ? 0x7fu : 0xffu;
  static constexpr uint32_t kZero = 0, kNan = 1, kInf = 2;
};

// The forms of each kind (functions, not constants: device code may call constexpr functions).
template <bool kSigned>
constexpr CodeForm narrow_code_form() {
  return kSigned ? make_code_form(0x7fu, 0, 1) : make_code_form(0xffu, 32, 3);
}

template <bool kSigned>
constexpr CodeForm wide_code_form() {
  return kSigned ? make_code_form(0x7fu, 0, 2) : narrow_code_form<false>();
}

// Mean binades below a signed block's largest value above which it takes the wide form.
constexpr uint32_t kWideBinades = 4;

// Every code of a form shares the bits its shift drops, and its smallest value code's relative
// value is a power of two (signed forms: stochastic rounding below it is one multiply).
static_assert(narrow_code_form<true>().smallest_bits == (116u << 23), "narrow signed codes reach 2^-11");
static_assert(wide_code_form<true>().smallest_bits == (107u << 23), "wide signed codes reach 2^-20");
static_assert(narrow_code_form<true>().top_bits == 0x3f7c0000u, "narrow signed top code: 1 - 2^-6");
static_assert(wide_code_form<true>().top_bits == 0x3f780000u, "wide signed top code: 1 - 2^-5");
static_assert(narrow_code_form<false>().top_bits == 0x3f7c0000u, "unsigned top code: 1 - 2^-6");
static_assert(real_code_offset_inverts(narrow_code_form<true>(), 0x7fu), "narrow signed codes invert");
static_assert(real_code_offset_inverts(wide_code_form<true>(), 0x7fu), "wide signed codes invert");
static_assert(real_code_offset_inverts(narrow_code_form<false>(), 0xffu), "unsigned codes invert");

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

template <bool kSigned>
FUSEDAMP_HOST_DEVICE CodeForm code_form(bool wide) {
  return wide ? wide_code_form<kSigned>() : narrow_code_form<kSigned>();
}

// [note: unbiased state rounding] An optimizer step stores each coded state rounded
// stochastically: up with probability (distance to the lower neighbour) / spacing, with random
// bits from math/stochastic.h's keyed hash. Round to nearest loses every change smaller than half
// a code step, and a moment's change per step is (1 - beta) of its distance to the new value:
// with beta2 = 0.999 that is far below half a step, so the second moment froze near its early
// value and the effective learning rate kept growing (the params moved ever farther than AdamW's).
// Rounded without bias, each state tracks its fp32 value in expectation. Conversions
// (encode_state, loading a torch state_dict) round to nearest.
//
// A rounding is given as a "unit": the float bits of a number in [1, 2) whose fraction is the
// threshold the code's position must pass to round up (1.5: to nearest, ties up).
constexpr uint32_t kNearestCodeUnit = 0x3fc00000u;

// [note: shared state draws] A draw per element costs a coded state's store (the keyed hash,
// [note: dither phases] in math/stochastic.h), so two states of one step (AdamW's moments) share
// one 32-bit draw per element: the second moment takes its high 20 bits, the first moment its
// low 12. Each state still rounds without bias to
// within a fraction of a step that its changes per step exceed: a second moment's change is
// (1 - beta2) of its distance to g^2, down to 1e-4 (beta2 = 0.9999), and its threshold has 20
// bits (bias below 2^-21 of a step); a first moment's change is (1 - beta1) of its distance, and
// its threshold 12 bits (2^-13). A bf16 state takes 16 bits of either half. A state with a stream
// to itself (SGD's and Muon's momentum, AMSGrad's maximum) takes the high share of its own draws.
enum class DrawShare : int32_t {
  kWhole,  // the draw is the state's own
  kLow,    // the low bits of a draw shared with a kHigh state
  kHigh,   // the high bits of a draw shared with a kLow state
};

// The unit ([note: unbiased state rounding]) of a stochastic code rounding from share S of a draw:
// its bits as the fraction, centred in the interval they leave.
template <DrawShare S = DrawShare::kWhole>
FUSEDAMP_HOST_DEVICE uint32_t stochastic_code_unit(uint32_t random) {
  if constexpr (S == DrawShare::kLow) {
    return ((random << 11) & 0x7ff800u) | 0x3f800400u;
  } else {
    return ((random >> 9) & 0x7ffff8u) | 0x3f800004u;
  }
}

// The draw bits whose low 16 float_to_bf16_state adds.
template <DrawShare S = DrawShare::kWhole>
FUSEDAMP_HOST_DEVICE uint32_t bf16_state_random(uint32_t random) {
  if constexpr (S == DrawShare::kHigh) {
    return random >> 16;
  } else {
    return random;
  }
}

// A block's scale as a float (its form's flag cleared) and its form.
FUSEDAMP_HOST_DEVICE float scale_value(uint16_t stored) { return bf16_to_float(uint16_t(stored & 0x7fffu)); }
FUSEDAMP_HOST_DEVICE bool scale_is_wide(uint16_t stored) { return (stored & 0x8000u) != 0u; }

// The magnitude bits a block's maximum is taken over: non-finite values count as 0.
FUSEDAMP_HOST_DEVICE uint32_t finite_magnitude_bits(float value) {
  const uint32_t magnitude = float_bits(value) & 0x7fffffffu;
  return select_bits(magnitude < 0x7f800000u, magnitude, 0u);
}

// The exponent field of magnitude bits: what a signed block sums to choose its form.
FUSEDAMP_HOST_DEVICE uint32_t magnitude_exponent(uint32_t magnitude_bits) { return magnitude_bits >> 23; }

// Whether a block of n values (n >= 1) whose largest finite magnitude has bits max_bits and whose
// magnitude_exponent values sum to exponent_sum takes the wide form (unsigned states: never): its
// values lie on average more than kWideBinades binades below the largest; within half a binade of
// that, the block keeps the form it had (`was_wide`), so that a block near the edge does not flip
// between forms from step to step ([note: steady scales]).
template <bool kSigned>
FUSEDAMP_HOST_DEVICE bool block_is_wide(uint32_t max_bits, uint32_t exponent_sum, uint32_t n, bool was_wide) {
  if constexpr (kSigned) {
    // n times (mean distance below the largest - kWideBinades), doubled.
    const int64_t excess = 2 * (int64_t(n) * magnitude_exponent(max_bits) - int64_t(exponent_sum) -
                                int64_t(kWideBinades) * n);
    return excess > int64_t(n) ? true : excess < -int64_t(n) ? false : was_wide;
  } else {
    return false;
  }
}

// [note: steady scales] A step keeps a block's scale while the block's largest value stays in
// the top 2^-5 of what the scale reaches (and its form stays): a scale that moved with every
// step's largest value moves every code's grid by up to half a step, and with the dithered draws
// ([note: dithered draws] in math/stochastic.h) those moves and the roundings fell into step with
// each other: the second moments of a 10^4-step run drifted 20% low. On a steady grid the
// dithered roundings of each value cancel over the steps as they should.
constexpr float kScaleSlack = 0x1.0p-5f;

// The stored scale of a block (bf16 bits, the form in the sign bit): `previous` (the scale the
// block had; 0 for none) when it still fits ([note: steady scales]), else the block's largest
// finite magnitude over the form's top value, rounded up to bf16 (the largest finite one at
// most); 0 for a block whose largest magnitude is below FLT_MIN.
template <bool kSigned>
FUSEDAMP_HOST_DEVICE uint16_t block_scale_bits(uint32_t max_bits, bool wide, uint16_t previous = 0) {
  if (max_bits < 0x00800000u) return uint16_t(wide ? 0x8000u : 0u);
  const float top = float_from_bits(code_form<kSigned>(wide).top_bits);
  const float largest = float_from_bits(max_bits);
  if ((previous & 0x7fffu) != 0u && scale_is_wide(previous) == wide) {
    const float reach = scale_value(previous) * top;
    if (largest <= reach && largest >= reach - reach * kScaleSlack) return previous;
  }
  uint32_t scale = (float_bits(largest / top) + 0xffffu) >> 16;
  scale = scale > 0x7f7fu ? 0x7f7fu : scale;
  return uint16_t(scale | (wide ? 0x8000u : 0u));
}

// What encoding a block's values needs: the multiplier that takes a magnitude to its value
// relative to the scale (rel(c) of its code's position), and the form.
struct BlockEncoding {
  float inverse;  // 1 / scale; 0 for a block of scale 0
  bool wide;
};

FUSEDAMP_HOST_DEVICE BlockEncoding block_encoding(uint16_t stored) {
  const float scale = scale_value(stored);
  return {scale == 0.0f ? 0.0f : 1.0f / scale, scale_is_wide(stored)};
}

// The code of `value` in a block of `encoding`, rounded with `unit` (kNearestCodeUnit or
// stochastic_code_unit). A NaN is the one NaN code, with no sign: NaN payloads and signs differ
// between CPU and GPU arithmetic, the codes must not.
template <bool kSigned>
FUSEDAMP_HOST_DEVICE uint8_t encode_code(float value, BlockEncoding encoding, uint32_t unit = kNearestCodeUnit) {
  using Code = BlockCode<kSigned>;
  const CodeForm form = code_form<kSigned>(encoding.wide);
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  // The value relative to the scale, clamped to the codes' range (a NaN or inf too: its code
  // is set below), read back as a real-valued code plus offset: a float in [smallest, top] + offset.
  const float relative = float_from_bits(magnitude) * encoding.inverse;
  uint32_t position = float_bits(relative) < form.smallest_bits ? form.smallest_bits : float_bits(relative);
  position = position > form.top_bits ? form.top_bits : position;
  const float real_code = float_from_bits((position >> form.shift) + form.real_code_offset);
  uint32_t code = uint32_t(int32_t(real_code + float_from_bits(unit))) - (form.offset + 1u);
  if (float_bits(relative) < form.smallest_bits) {
    if constexpr (kSigned) {
      // Up to the smallest code with probability value / its value (a power of two).
      const float scaled = relative * float_from_bits((254u << 23) - form.smallest_bits);
      code = select_bits(scaled + float_from_bits(unit) >= 2.0f, form.smallest_code, Code::kZero);
    } else {
      code = select_bits(magnitude != 0u, form.smallest_code, Code::kZero);
    }
  }
  code = select_bits(magnitude >= 0x7f800000u,
                     select_bits(magnitude == 0x7f800000u, Code::kInf, Code::kNan), code);
  if constexpr (kSigned) code |= select_bits(magnitude > 0x7f800000u, 0u, (bits >> 24) & 0x80u);
  return uint8_t(code);
}

// A bf16 state value: `value` rounded stochastically with `random` (low 16 bits), a NaN as the one
// quiet NaN 0x7fc0 ([note: unbiased state rounding]; encode_code says why NaN is canonical).
FUSEDAMP_HOST_DEVICE uint16_t float_to_bf16_state(float value, uint32_t random) {
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const uint32_t rounded = select_bits(magnitude == 0x7f800000u, bits, bits + (random & 0xffffu)) >> 16;
  return uint16_t(select_bits(magnitude > 0x7f800000u, 0x7fc0u, rounded));
}

// The relative value of a value code's magnitude in a form (decode_code without the scale).
FUSEDAMP_HOST_DEVICE float relative_code_value(uint32_t magnitude, const CodeForm& form) {
  const float integer = float(int32_t(magnitude + form.offset));
  return float_from_bits((float_bits(integer) << form.shift) + form.bias);
}

template <bool kSigned>
FUSEDAMP_HOST_DEVICE float decode_code(uint8_t code, uint16_t stored_scale) {
  using Code = BlockCode<kSigned>;
  const uint32_t magnitude = uint32_t(code) & Code::kMagnitudeMask;
  const float value = relative_code_value(magnitude, code_form<kSigned>(scale_is_wide(stored_scale))) *
                      scale_value(stored_scale);
  const uint32_t special = select_bits(magnitude == Code::kZero, 0u,
                                       select_bits(magnitude == Code::kNan, 0x7fc00000u, 0x7f800000u));
  uint32_t result = select_bits(magnitude > Code::kInf, float_bits(value), special);
  if constexpr (kSigned) result |= (uint32_t(code) & 0x80u) << 24;
  return float_from_bits(result);
}

FUSEDAMP_NAMESPACE_END

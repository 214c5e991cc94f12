// Optimizer state codecs ([note: state codecs]): how a moment is stored (fp32, bf16, or 8-bit
// codes with one power-of-two scale per block of kCodecBlock elements), loaded as fp32 and stored
// back, rounded stochastically by the optimizer steps ([note: unbiased state rounding]).
#pragma once

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// How an optimizer's per-element states (moments, momentum buffers) are stored. One codec per call.
enum class StateCodec : int32_t {
  kFloat32 = 0,   // float per element
  kBFloat16 = 1,  // bf16 per element
  kInt8 = 2,      // uint8 code per element + one fp32 scale per block ([note: block codes])
};

// Elements per scale of kInt8. Every chunk of both backends is a multiple of it, so a block
// always belongs to one chunk (one task or one CUDA block).
constexpr int64_t kCodecBlock = 256;

inline int64_t codec_blocks(int64_t numel) { return (numel + kCodecBlock - 1) / kCodecBlock; }

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// [note: block codes] An 8-bit code is a tiny float relative to its block's scale 2^k: signed
// states (exp_avg, momentum) use sign + 4 exponent + 3 mantissa bits, unsigned ones (exp_avg_sq,
// max_exp_avg_sq) 5 exponent + 3 mantissa bits. Exponent field E in [1, 2^e - 1] means
// 2^(E - (2^e - 1)) * (1 + M / 8) * scale, so the top binade holds the block's largest value and
// each value keeps 3 bits of mantissa in the 15 (signed) or 31 (unsigned) binades below it. The
// encoding is integer work on the fp32 bit pattern (round the mantissa to 3 bits, nearest, ties up,
// and rebase the exponent): no table, no search, no division, so it vectorizes on AVX2 and the
// codes are bitwise the same on every ISA build and on CUDA. E = 0 is not a value: M = 0 is zero,
// 1 is NaN, 2 is inf (sign in the sign bit), so a non-finite moment stays what torch would hold
// instead of poisoning its block. Values below the bottom binade flush to zero, except in
// unsigned states, where a nonzero value becomes the smallest code: a second moment never turns
// into 0 under a nonzero first moment (that would divide the update by eps alone).
template <bool kSigned>
struct BlockCode {
  static constexpr int32_t kExponentBits = kSigned ? 4 : 5;
  static constexpr int32_t kTopExponent = (1 << kExponentBits) - 1;
  static constexpr uint32_t kMagnitudeMask = kSigned ? 0x7fu : 0xffu;
  static constexpr uint32_t kNan = 1, kInf = 2, kSmallest = 8;
};

// [note: unbiased state rounding] An optimizer step stores each coded state rounded
// stochastically: up with probability (distance to the lower neighbour) / spacing, with random
// bits from math/stochastic.h's keyed hash. Round to nearest loses every change smaller than half
// a code step, and a moment's change per step is (1 - beta) of its distance to the new value:
// with beta2 = 0.999 that is far below half a step of 3 mantissa bits (or bf16's 8), so the
// second moment froze near its early value and the effective learning rate kept growing (the
// params moved ever farther than AdamW's). Rounded without bias, each state tracks its fp32 value
// in expectation. Conversions (encode_state, loading a torch state_dict) round to nearest.

// What a code's rounding adds to the magnitude bits before their 20 low mantissa bits are dropped:
// half a step (round to nearest, ties away from zero: one add fewer than ties to even), or a
// uniform random amount below one step (stochastic_code_rounding).
constexpr uint32_t kNearestCodeRounding = 0x80000u;
// The largest amount stochastic_code_rounding adds: a block's top is taken with it, so that no
// value of the block rounds past the top binade.
constexpr uint32_t kMaxStochasticCodeRounding = 0xfffffu;

// [note: shared state draws] The keyed hash is the costliest part of a coded state's store, so
// two states of one step (AdamW's moments) share one 32-bit draw per element: the second moment
// takes its high bits, the first moment its low ones. Each state still rounds without bias to
// within a fraction of a step that its changes per step exceed: a second moment's change is
// (1 - beta2) of its distance to g^2, down to 1e-4 (beta2 = 0.9999) of a value with 3 mantissa
// bits, so a code keeps the 20 high bits (bias below 2^-20 of a step); a first moment's change is
// (1 - beta1) of its distance, and its code takes 12 bits and half of the next one (bias within
// 2^-13 of a step either way). A bf16 state takes 16 bits of either half. A state with a stream
// to itself (SGD's and Muon's momentum, AMSGrad's maximum) takes its draws whole.
enum class DrawShare : int32_t {
  kWhole,  // the draw is the state's own
  kLow,    // the low bits of a draw shared with a kHigh state
  kHigh,   // the high bits of a draw shared with a kLow state
};

template <DrawShare S = DrawShare::kWhole>
FUSEDAMP_HOST_DEVICE uint32_t stochastic_code_rounding(uint32_t random) {
  if constexpr (S == DrawShare::kLow) {
    return ((random & 0xfffu) << 8) | 0x80u;
  } else {
    return random >> 12;
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

// What a block keeps of its largest finite magnitude (max over the block of finite_magnitude_bits),
// rounded up by the largest amount its codes' rounding may add: the biased fp32 exponent, in
// [0, 254]. 0: an all-zero (or all-subnormal) block, which stores as zeros.
FUSEDAMP_HOST_DEVICE uint32_t block_top_exponent(uint32_t max_magnitude_bits, uint32_t max_rounding) {
  const uint32_t exponent = (max_magnitude_bits + max_rounding) >> 23;
  return exponent > 254u ? 254u : exponent;
}

// The magnitude bits a block's maximum is taken over: non-finite values count as 0.
FUSEDAMP_HOST_DEVICE uint32_t finite_magnitude_bits(float value) {
  const uint32_t magnitude = float_bits(value) & 0x7fffffffu;
  return select_bits(magnitude < 0x7f800000u, magnitude, 0u);
}

// The stored scale of a block: 2^(top_exponent - 127), or 0 for an all-zero block.
FUSEDAMP_HOST_DEVICE float block_scale(uint32_t top_exponent) {
  return float_from_bits(select_bits(top_exponent != 0u, top_exponent << 23, 0u));
}

// The biased fp32 exponent of a block scale (the inverse of block_scale).
FUSEDAMP_HOST_DEVICE uint32_t scale_top_exponent(float scale) { return float_bits(scale) >> 23; }

// The code of `value` in a block of top exponent `top_exponent`, its magnitude rounded by
// `rounding` (kNearestCodeRounding or stochastic_code_rounding). A NaN is the one NaN code, with no
// sign: NaN payloads and signs differ between CPU and GPU arithmetic, the codes must not.
template <bool kSigned>
FUSEDAMP_HOST_DEVICE uint8_t encode_code(float value, uint32_t top_exponent,
                                         uint32_t rounding = kNearestCodeRounding) {
  using Code = BlockCode<kSigned>;
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const int32_t offset = (int32_t(top_exponent) - Code::kTopExponent) * 8;
  int32_t code = int32_t((magnitude + rounding) >> 20) - offset;
  code = code > int32_t(Code::kMagnitudeMask) ? int32_t(Code::kMagnitudeMask) : code;
  // Normal fp32 values at or above the bottom binade keep their code; the rest flush.
  const bool representable = (code >= 8) & (magnitude >= 0x00800000u) & (top_exponent != 0u);
  const uint32_t flushed = kSigned ? 0u : select_bits(magnitude != 0u, Code::kSmallest, 0u);
  uint32_t result = select_bits(representable, uint32_t(code), flushed);
  result = select_bits(magnitude >= 0x7f800000u,
                       select_bits(magnitude == 0x7f800000u, Code::kInf, Code::kNan), result);
  if constexpr (kSigned) result |= select_bits(magnitude > 0x7f800000u, 0u, (bits >> 24) & 0x80u);
  return uint8_t(result);
}

// A bf16 state value: `value` rounded stochastically with `random` (low 16 bits), a NaN as the one
// quiet NaN 0x7fc0 ([note: unbiased state rounding]; encode_code says why NaN is canonical).
FUSEDAMP_HOST_DEVICE uint16_t float_to_bf16_state(float value, uint32_t random) {
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const uint32_t rounded = select_bits(magnitude == 0x7f800000u, bits, bits + (random & 0xffffu)) >> 16;
  return uint16_t(select_bits(magnitude > 0x7f800000u, 0x7fc0u, rounded));
}

template <bool kSigned>
FUSEDAMP_HOST_DEVICE float decode_code(uint8_t code, float scale) {
  using Code = BlockCode<kSigned>;
  const uint32_t magnitude = uint32_t(code) & Code::kMagnitudeMask;
  // (magnitude << 20) puts E and M in fp32 position; the bias makes E = top the binade of 1.
  const float relative = float_from_bits((magnitude << 20) + uint32_t(127 - Code::kTopExponent) * (1u << 23));
  const uint32_t normal = float_bits(relative * scale);
  const uint32_t special = select_bits(magnitude == 0u, 0u,
                                       select_bits(magnitude == Code::kNan, 0x7fc00000u, 0x7f800000u));
  uint32_t result = select_bits(magnitude >= 8u, normal, special);
  if constexpr (kSigned) result |= (uint32_t(code) & 0x80u) << 24;
  return float_from_bits(result);
}

FUSEDAMP_NAMESPACE_END

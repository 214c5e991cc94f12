// Optimizer state codecs (DESIGN.md rule 7): how a moment is stored (fp32, bf16, or 8-bit codes
// with one power-of-two scale per block of kCodecBlock elements), loaded as fp32 and stored back.
#pragma once

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// How an optimizer's per-element states (moments, momentum buffers) are stored. One codec per call.
enum class StateCodec : int32_t {
  kFloat32 = 0,   // float per element
  kBFloat16 = 1,  // bf16 per element, round to nearest even
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

// The fp32 bit pattern of |bits| rounded to 3 mantissa bits (nearest, ties away from zero: one add
// fewer than ties to even, in the vector encoders' busiest loop); may carry into the next binade.
FUSEDAMP_HOST_DEVICE uint32_t round_to_code_mantissa(uint32_t magnitude_bits) {
  return magnitude_bits + 0x80000u;
}

// What a block keeps of its largest finite magnitude (max over the block of finite_magnitude_bits):
// the biased fp32 exponent of it rounded to the code's mantissa, in [0, 254]. 0: an all-zero (or
// all-subnormal) block, which stores as zeros.
FUSEDAMP_HOST_DEVICE uint32_t block_top_exponent(uint32_t max_magnitude_bits) {
  const uint32_t exponent = round_to_code_mantissa(max_magnitude_bits) >> 23;
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

template <bool kSigned>
FUSEDAMP_HOST_DEVICE uint8_t encode_code(float value, uint32_t top_exponent) {
  using Code = BlockCode<kSigned>;
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const int32_t offset = (int32_t(top_exponent) - Code::kTopExponent) * 8;
  int32_t code = int32_t(round_to_code_mantissa(magnitude) >> 20) - offset;
  code = code > int32_t(Code::kMagnitudeMask) ? int32_t(Code::kMagnitudeMask) : code;
  // Normal fp32 values at or above the bottom binade keep their code; the rest flush.
  const bool representable = (code >= 8) & (magnitude >= 0x00800000u) & (top_exponent != 0u);
  const uint32_t flushed = kSigned ? 0u : select_bits(magnitude != 0u, Code::kSmallest, 0u);
  uint32_t result = select_bits(representable, uint32_t(code), flushed);
  result = select_bits(magnitude >= 0x7f800000u,
                       select_bits(magnitude == 0x7f800000u, Code::kInf, Code::kNan), result);
  if constexpr (kSigned) result |= (bits >> 24) & 0x80u;
  return uint8_t(result);
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

// Reading and writing the fp32 value an optimizer updates: the param itself, a separate fp32
// master, or a bf16 param plus the 16 "remainder" bits that make it an exact fp32 master.
#pragma once

#include <type_traits>

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

enum class MasterKind : int32_t {
  kNone = 0,       // the param is the value updated (rounded back to its dtype)
  kFloat32 = 1,    // fp32 master; the param receives the master rounded to nearest even
  kRemainder = 2,  // bf16 param = high half of the master, int16 remainder = the rest
};

// The element type of a master tensor (none for kNone: the pointer is then never used).
template <MasterKind M>
using master_storage_t = std::conditional_t<M == MasterKind::kRemainder, int16_t, float>;

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// [note: remainder encoding] master_bits = (param_bits << 16) + sign_extend(remainder), mod 2^32.
// The param is the master rounded half-up on the bit pattern (differs from round-to-nearest-even
// only on exact ties, by one bf16 ulp), which keeps the remainder within int16 and the
// reconstruction exact: the fp32 master trajectory is bit-identical to kFloat32 mode.
FUSEDAMP_HOST_DEVICE float join_bf16_remainder(uint16_t high, int16_t remainder) {
  return float_from_bits((uint32_t(high) << 16) + uint32_t(int32_t(remainder)));
}

// A NaN master has no exact split (bits + 0x8000 would wrap a NaN into a signed zero): it becomes
// the quiet bf16 NaN that float_to_bf16 gives, with a zero remainder, so it stays a NaN.
FUSEDAMP_HOST_DEVICE void split_bf16_remainder(float master, uint16_t& high, int16_t& remainder) {
  const uint32_t bits = float_bits(master);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  high = uint16_t(select_bits(nan, (bits >> 16) | 0x40u, (bits + 0x8000u) >> 16));
  remainder = int16_t(int32_t(select_bits(nan, 0u, bits - (uint32_t(high) << 16))));
}

template <DType P, MasterKind M>
FUSEDAMP_HOST_DEVICE float load_master(const void* param, const void* master, int64_t index) {
  if constexpr (M == MasterKind::kNone) {
    return load_float<P>(static_cast<const storage_t<P>*>(param), index);
  } else if constexpr (M == MasterKind::kFloat32) {
    return static_cast<const float*>(master)[index];
  } else {
    static_assert(P == DType::kBFloat16, "remainder masters need bf16 params");
    return join_bf16_remainder(static_cast<const uint16_t*>(param)[index],
                               static_cast<const int16_t*>(master)[index]);
  }
}

template <DType P, MasterKind M>
FUSEDAMP_HOST_DEVICE void store_master(void* param, void* master, int64_t index, float value) {
  if constexpr (M == MasterKind::kRemainder) {
    static_assert(P == DType::kBFloat16, "remainder masters need bf16 params");
    uint16_t high;
    int16_t remainder;
    split_bf16_remainder(value, high, remainder);
    static_cast<uint16_t*>(param)[index] = high;
    static_cast<int16_t*>(master)[index] = remainder;
  } else {
    if constexpr (M == MasterKind::kFloat32) static_cast<float*>(master)[index] = value;
    store_float<P>(static_cast<storage_t<P>*>(param), index, value);
  }
}

// The gradient as the update sees it: loaded, unscaled and clipped with one multiply
// (multiplier = inv_scale * clip_coef), optionally written back so that after the step the
// .grad holds what the step used, as torch's fused optimizers leave it.
template <DType G>
FUSEDAMP_HOST_DEVICE float prepare_grad(void* grad, int64_t index, float multiplier, bool write_back) {
  auto* typed = static_cast<storage_t<G>*>(grad);
  const float value = load_float<G>(typed, index) * multiplier;
  if (write_back) store_float<G>(typed, index, value);
  return value;
}

FUSEDAMP_NAMESPACE_END

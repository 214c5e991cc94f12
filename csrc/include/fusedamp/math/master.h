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

// [note: edited params] A param written outside the step (clamp_, zero_, copy_, p.data = t, a
// model's load_state_dict, a torch.optim step on the same state) is what the next step starts
// from, per element and with no flag to set (version counters miss p.data edits):
// - an fp32 master: the step leaves the param equal to the master rounded to the param's dtype,
//   so a param that is not that rounding was edited, and its value replaces the master
//   (master_or_edited_param; reading the param costs 2 bytes a param).
// - a remainder: an edited param joined with its old remainder is within half a bf16 ulp of the
//   param (the master's own precision), except for the pairs that split never makes: a zero
//   param with a negative remainder (the join is a NaN or has the other sign) and an infinite
//   one with a positive remainder (a NaN). join_bf16_remainder reads those as the param alone.
FUSEDAMP_HOST_DEVICE float join_bf16_remainder(uint16_t high, int16_t remainder) {
  const uint32_t magnitude = high & 0x7fffu;
  const bool edited = ((magnitude == 0u) & (remainder < 0)) | ((magnitude == 0x7f80u) & (remainder > 0));
  return float_from_bits((uint32_t(high) << 16) + select_bits(edited, 0u, uint32_t(int32_t(remainder))));
}

// The value a step on a half param with an fp32 master starts from ([note: edited params]).
template <DType P>
FUSEDAMP_HOST_DEVICE float master_or_edited_param(float master, storage_t<P> param) {
  storage_t<P> rounded;
  store_float<P>(&rounded, 0, master);
  return select_float(rounded == param, master, load_float<P>(&param, 0));
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
    const float value = static_cast<const float*>(master)[index];
    // An fp32 param here is a staged tile (cpu/staging.h), whose master staged_tile checked.
    if constexpr (P == DType::kFloat32) {
      return value;
    } else {
      return master_or_edited_param<P>(value, static_cast<const storage_t<P>*>(param)[index]);
    }
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

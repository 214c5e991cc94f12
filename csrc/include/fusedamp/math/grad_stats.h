// Per-element math of the gradient diagnostics: how each gradient value would fare in fp16.
#pragma once

#include <math.h>

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// Statistics of one tensor (or one chunk of it). Exact zeros count in neither "below" field:
// they lose nothing in fp16.
struct GradStats {
  int64_t below_min_subnormal = 0;  // 0 < |g| < 2^-24
  int64_t below_min_normal = 0;     // 0 < |g| < 2^-14 (includes the previous)
  int64_t non_finite = 0;           // +-inf and NaN
  float max_abs = 0.0f;             // largest |g| of a finite stored value (inf if g overflows)
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// Below the smallest fp16 subnormal a nonzero value is lost (flushes to zero or to 2^-24);
// below the smallest fp16 normal it keeps fewer than fp16's 10 mantissa bits.
constexpr float kFp16MinSubnormal = 0x1.0p-24f;
constexpr float kFp16MinNormal = 0x1.0p-14f;

// Adds grad[index] * multiplier to `stats`; multiplier is the inverse loss scale, so the
// statistics describe the true (unscaled) gradient. Non-finiteness is judged on the stored
// value, as unscale_ does.
template <DType G>
FUSEDAMP_HOST_DEVICE void accumulate_grad_stats(const storage_t<G>* grad, int64_t index,
                                                float multiplier, GradStats& stats) {
  const float value = load_float<G>(grad, index);
  const bool finite = !is_non_finite(value);
  const float magnitude = finite ? fabsf(value * multiplier) : 0.0f;
  const bool nonzero = magnitude > 0.0f;
  stats.non_finite += !finite;
  stats.below_min_subnormal += nonzero && magnitude < kFp16MinSubnormal;
  stats.below_min_normal += nonzero && magnitude < kFp16MinNormal;
  stats.max_abs = fmaxf(stats.max_abs, magnitude);
}

FUSEDAMP_HOST_DEVICE void merge_grad_stats(GradStats& into, const GradStats& part) {
  into.below_min_subnormal += part.below_min_subnormal;
  into.below_min_normal += part.below_min_normal;
  into.non_finite += part.non_finite;
  into.max_abs = fmaxf(into.max_abs, part.max_abs);
}

FUSEDAMP_NAMESPACE_END

// Per-element math of the AMP gradient passes: unscale with inf-check, and the read-only check.
#pragma once

#include "fusedamp/math/dtypes.h"

FUSEDAMP_NAMESPACE_BEGIN

// grad[i] *= inv_scale in place; returns whether the value read was non-finite.
// The check looks at the scaled value, as torch does: inv_scale never turns inf into finite.
template <DType G>
FUSEDAMP_HOST_DEVICE bool unscale_element(storage_t<G>* grad, int64_t index, float inv_scale) {
  const float value = load_float<G>(grad, index);
  store_float<G>(grad, index, value * inv_scale);
  return is_non_finite(value);
}

// Read-only pass: adds (multiplier * grad[i])^2 to sum_of_squares, returns non-finiteness.
// multiplier is the inverse loss scale, so the norm is that of the unscaled gradient and
// cannot overflow fp32 just because the loss scale is large.
template <DType G>
FUSEDAMP_HOST_DEVICE bool check_element(const storage_t<G>* grad, int64_t index, float multiplier,
                                        float& sum_of_squares) {
  const float value = load_float<G>(grad, index);
  const float unscaled = value * multiplier;
  sum_of_squares += unscaled * unscaled;
  return is_non_finite(value);
}

FUSEDAMP_NAMESPACE_END

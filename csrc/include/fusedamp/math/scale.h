// Dynamic loss-scale update: torch's _amp_update_scale_ semantics plus hysteresis and bounds.
#pragma once

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

struct LossScaleConfig {
  double growth_factor;    // > 1; double, as torch multiplies the fp32 scale by the double factor
  double backoff_factor;   // < 1  and rounds once (a factor rounded to fp32 first can be an ulp off)
  int32_t growth_interval; // clean steps in a row before the scale grows
  int32_t hysteresis;      // overflows tolerated before backing off; 1 = torch's behaviour
  float min_scale;         // backoff never goes below this (0 = unbounded)
  float max_scale;         // growth never goes above this (inf = unbounded)
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// [note: found_inf] found_inf means "some gradient was inf/NaN" whenever it is not exactly 0: it
// may be a count, a sum over devices or ranks, or itself NaN. Every reader asks this function.
FUSEDAMP_HOST_DEVICE bool found_non_finite(float found_inf) { return found_inf != 0.0f; }

// Hysteresis (Megatron's rule): each overflow spends one unit of hysteresis_left and the scale
// backs off once it is spent; a growth step refills it. With hysteresis == 1, min_scale == 0
// and max_scale == inf this is exactly torch._amp_update_scale_.
FUSEDAMP_HOST_DEVICE void update_loss_scale(float& scale, int32_t& growth_tracker,
                                            int32_t& hysteresis_left, float found_inf,
                                            const LossScaleConfig& config) {
  if (found_non_finite(found_inf)) {
    growth_tracker = 0;
    hysteresis_left = hysteresis_left > 1 ? hysteresis_left - 1 : 0;
    if (hysteresis_left == 0) {
      const float backed_off = float(double(scale) * config.backoff_factor);
      scale = backed_off > config.min_scale ? backed_off : config.min_scale;
    }
    return;
  }
  const int32_t successful = growth_tracker + 1;
  if (successful < config.growth_interval) {
    growth_tracker = successful;
    return;
  }
  const float grown = float(double(scale) * config.growth_factor);
  const float bounded = grown < config.max_scale ? grown : config.max_scale;
  // Growing must never produce inf: keep the old scale then (torch does the same).
  if (!is_non_finite(bounded)) scale = bounded;
  growth_tracker = 0;
  hysteresis_left = config.hysteresis;
}

FUSEDAMP_NAMESPACE_END

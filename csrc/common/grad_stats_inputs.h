// Argument validation of fusedamp::grad_stats, shared by its CPU and CUDA backends.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// Columns of grad_stats' counts output: below 2^-24, below 2^-14, non-finite.
constexpr int64_t kGradStatsCounts = 3;

struct GradStatsCall {
  std::vector<int64_t> numels;
  std::vector<DType> dtypes;
  at::Device device;
};

// Grads: strided, non-overlapping and dense (any memory order: statistics ignore it), float
// dtypes, one device; inv_scale, when given, a one-element float32 tensor on that device.
GradStatsCall check_grad_stats_call(at::TensorList grads, const c10::optional<at::Tensor>& inv_scale);

}  // namespace fusedamp

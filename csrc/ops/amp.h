// The call structs of the AMP gradient ops (unscale_, check_and_norm_, update_scale_), checked
// once by ops/amp.cpp.
#pragma once

#include <c10/core/Device.h>

#include <vector>

#include "common/tensor_lists.h"
#include "fusedamp/math/dtypes.h"
#include "fusedamp/math/scale.h"

namespace fusedamp {

struct UnscaleCall {
  static constexpr const char* kOp = "unscale_";
  // Unscales elements [begin, end) of grad `tensor`; returns whether one was non-finite.
  using CpuChunk = bool (*)(const UnscaleCall&, int64_t tensor, int64_t begin, int64_t end);
  c10::Device device;
  TensorLists<1> grads;
  std::vector<DType> dtypes;  // per grad
  float* found_inf;
  const float* inv_scale;
};

// What check_and_norm_ finds in a range of a grad.
struct GradCheck {
  float sum_of_squares = 0.0f;  // of grad * inv_scale
  bool found_non_finite = false;
};

struct CheckAndNormCall {
  static constexpr const char* kOp = "check_and_norm_";
  using CpuChunk = GradCheck (*)(const CheckAndNormCall&, int64_t tensor, int64_t begin, int64_t end);
  c10::Device device;
  TensorLists<1> grads;
  std::vector<DType> dtypes;  // per grad
  float* found_inf;
  float* sum_of_squares;   // null: no norm wanted
  const float* inv_scale;  // null: multiplier 1
};

struct UpdateScaleCall {
  static constexpr const char* kOp = "update_scale_";
  c10::Device device;
  float* scale;
  int32_t* growth_tracker;
  int32_t* hysteresis_tracker;
  const float* found_inf;
  LossScaleConfig config;
};

}  // namespace fusedamp

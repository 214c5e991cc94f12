// The call struct of grad_stats, checked once by ops/grad_stats.cpp.
#pragma once

#include <c10/core/Device.h>

#include <vector>

#include "common/tensor_lists.h"
#include "fusedamp/math/grad_stats.h"

namespace fusedamp {

// Columns of grad_stats' counts output: below 2^-24, below 2^-14, non-finite.
constexpr int64_t kGradStatsCounts = 3;

struct GradStatsCall {
  static constexpr const char* kOp = "grad_stats";
  using CpuChunk = GradStats (*)(const GradStatsCall&, int64_t tensor, int64_t begin, int64_t end);
  c10::Device device;
  TensorLists<1> grads;
  std::vector<DType> dtypes;  // per grad
  const float* inv_scale;     // null: multiplier 1
  int64_t* counts;            // (grads, kGradStatsCounts), written by the kernel
  float* max_abs;             // (grads,), written by the kernel
};

}  // namespace fusedamp

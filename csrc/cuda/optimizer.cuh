// What the CUDA AdamW and SGD steps share: the scalar inputs every block reads on the device,
// and the step-counter increment that follows the update.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <type_traits>

#include "fusedamp/math/master.h"
#include "fusedamp/math/scale.h"

namespace fusedamp::cuda {

// Elements per thread per iteration of the optimizer kernels: with four to six lists per element
// that is already 50-100 bytes in flight per thread (one 128-bit access per fp32 list), and the
// kernels stay within ~64 registers, four 256-thread blocks per SM.
constexpr int kOptimizerElements = 4;

// The step's scalar inputs as device pointers, read by every block: nothing here makes the host
// wait for the device.
struct StepInputs {
  const float* found_inf;       // not 0: skip the whole step ([note: found_inf]); null: never skip
  const float* inv_grad_scale;  // null: 1
  const float* clip_coef;       // null: 1
  const float* lr;              // null: lr is host_lr
  double host_lr;               // the float lr argument, or a CPU lr_tensor read on the host
};

StepInputs step_inputs(double lr, const c10::optional<at::Tensor>& lr_tensor,
                       const c10::optional<at::Tensor>& inv_grad_scale,
                       const c10::optional<at::Tensor>& found_inf,
                       const c10::optional<at::Tensor>& clip_coef);

__device__ __forceinline__ bool step_skipped(const float* found_inf) {
  return found_inf != nullptr && found_non_finite(*found_inf);
}

// inv_grad_scale * clip_coef in float, each 1 when absent, as the CPU backend computes it.
__device__ __forceinline__ float grad_multiplier(const StepInputs& inputs) {
  return (inputs.inv_grad_scale ? *inputs.inv_grad_scale : 1.0f) *
         (inputs.clip_coef ? *inputs.clip_coef : 1.0f);
}

__device__ __forceinline__ double step_lr(const StepInputs& inputs) {
  return inputs.lr ? double(*inputs.lr) : inputs.host_lr;
}

// steps[i] += 1 for every param unless found_inf is set. Launched after the update kernels, which
// therefore read the count before the step (stream order).
void increment_steps(at::TensorList steps, const c10::optional<at::Tensor>& found_inf);

}  // namespace fusedamp::cuda

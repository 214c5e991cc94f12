// The scalar inputs of one AMP optimizer step, as the CPU and CUDA kernels of every optimizer
// read them: pointers into tensors on the step's device, so that no backend makes the host wait.
#pragma once

#include "fusedamp/math/scale.h"

namespace fusedamp {

struct StepInputs {
  const float* found_inf;       // not 0: skip the whole step ([note: found_inf]); null: never skip
  const float* inv_grad_scale;  // null: 1
  const float* clip_coef;       // null: 1
  const float* lr;              // null: lr is host_lr
  double host_lr;               // the float lr argument, or a CPU lr_tensor read on the host
  bool host_lr_from_tensor;     // host_lr was read from a CPU lr_tensor (a CUDA graph would freeze it)
  bool write_grad;              // write the unscaled (and clipped) grad back into grads
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE bool step_skipped(const StepInputs& inputs) {
  return inputs.found_inf != nullptr && found_non_finite(*inputs.found_inf);
}

// inv_grad_scale * clip_coef in float, each 1 when absent.
FUSEDAMP_HOST_DEVICE float grad_multiplier(const StepInputs& inputs) {
  return (inputs.inv_grad_scale ? *inputs.inv_grad_scale : 1.0f) *
         (inputs.clip_coef ? *inputs.clip_coef : 1.0f);
}

FUSEDAMP_HOST_DEVICE double step_lr(const StepInputs& inputs) {
  return inputs.lr ? double(*inputs.lr) : inputs.host_lr;
}

FUSEDAMP_NAMESPACE_END

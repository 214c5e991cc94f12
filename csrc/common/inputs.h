// Argument validation shared by the CPU and CUDA backends: every check lives here once, and
// turns the at::Tensor arguments into the plain element types the kernels take.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "fusedamp/math/dtypes.h"
#include "fusedamp/math/master.h"

namespace fusedamp {

// fp32 / fp16 / bf16 -> DType; anything else is a TORCH_CHECK error naming `what`.
DType float_dtype_of(const at::Tensor& tensor, const std::string& what);

// A 0-dim (or one-element) fp32 tensor on `device`: scale, found_inf, lr, clip_coef, steps.
void check_scalar_tensor(const at::Tensor& tensor, const char* what, const at::Device& device);

// Grads of unscale_/check_and_norm_: dense, contiguous, float dtypes, all on found_inf's device.
void check_grad_list(at::TensorList grads, const at::Tensor& found_inf, const char* op);

// What an optimizer call operates on, after validation.
struct OptimizerCall {
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  at::Device device;
};

// Validates one AdamW or SGD call. `states` are the fp32 per-param state lists (exp_avgs,
// exp_avg_sqs, max_exp_avg_sqs or momentum_buffers), each either empty (when `state_required`
// is false for it) or one tensor per param.
struct StateList {
  at::TensorList tensors;
  const char* name;
  bool required;
};
OptimizerCall check_optimizer_call(const char* op, at::TensorList params, at::TensorList grads,
                                   const std::vector<StateList>& states, at::TensorList masters,
                                   at::TensorList steps,
                                   const c10::optional<at::Tensor>& lr_tensor,
                                   const c10::optional<at::Tensor>& inv_grad_scale,
                                   const c10::optional<at::Tensor>& found_inf,
                                   const c10::optional<at::Tensor>& clip_coef);

void check_hyperparameter(double value, const char* name, const char* op);

}  // namespace fusedamp

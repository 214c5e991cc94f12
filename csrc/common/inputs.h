// Argument validation shared by the CPU and CUDA backends: every check lives here once, and
// turns the at::Tensor arguments into the plain element types the kernels take.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "fusedamp/math/dtypes.h"
#include "fusedamp/math/master.h"
#include "fusedamp/math/scale.h"

namespace fusedamp {

// fp32 / fp16 / bf16 -> DType; anything else is a TORCH_CHECK error naming `what`.
DType float_dtype_of(const at::Tensor& tensor, const std::string& what);

// A 0-dim (or one-element) fp32 tensor on `device`: scale, found_inf, lr, clip_coef, steps.
void check_scalar_tensor(const at::Tensor& tensor, const char* what, const at::Device& device);

// Grads of unscale_/check_and_norm_: dense (any memory format), float dtypes, on found_inf's device.
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

// The complete argument checks of each op: every backend calls the one of its op first.
void check_unscale_args(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale);
void check_check_and_norm_args(at::TensorList grads, const at::Tensor& found_inf,
                               const c10::optional<at::Tensor>& sum_of_squares,
                               const c10::optional<at::Tensor>& inv_scale);
// Returns the configuration update_loss_scale takes.
LossScaleConfig check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& hysteresis_tracker,
                                        const at::Tensor& found_inf, double growth_factor,
                                        double backoff_factor, int64_t growth_interval,
                                        int64_t hysteresis, double min_scale, double max_scale);
OptimizerCall check_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                               at::TensorList masters, at::TensorList steps, double lr,
                               const c10::optional<at::Tensor>& lr_tensor, double beta1,
                               double beta2, double eps, double weight_decay, bool amsgrad,
                               const c10::optional<at::Tensor>& inv_grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& clip_coef);
OptimizerCall check_sgd_args(at::TensorList params, at::TensorList grads,
                             at::TensorList momentum_buffers, at::TensorList masters,
                             at::TensorList steps, double lr,
                             const c10::optional<at::Tensor>& lr_tensor, double momentum,
                             double dampening, double weight_decay,
                             const c10::optional<at::Tensor>& inv_grad_scale,
                             const c10::optional<at::Tensor>& found_inf,
                             const c10::optional<at::Tensor>& clip_coef);

// Columns of grad_stats' counts output: below 2^-24, below 2^-14, non-finite.
constexpr int64_t kGradStatsCounts = 3;

struct GradStatsCall {
  std::vector<int64_t> numels;
  std::vector<DType> dtypes;
  at::Device device;
};

// The checks of grad_stats: grads dense (any memory format: statistics ignore the order), float
// dtypes, one device; inv_scale, when given, a one-element float32 tensor on that device.
GradStatsCall check_grad_stats_call(at::TensorList grads, const c10::optional<at::Tensor>& inv_scale);

// Whether an optimizer step writes the grad it used back into grads: when the caller asks and
// the step changed it (unscaled or clipped); otherwise the write would only cost bandwidth.
inline bool step_writes_grad(bool write_unscaled_grads, const c10::optional<at::Tensor>& inv_grad_scale,
                             const c10::optional<at::Tensor>& clip_coef) {
  return write_unscaled_grads && (inv_grad_scale.has_value() || clip_coef.has_value());
}

}  // namespace fusedamp

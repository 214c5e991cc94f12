// fusedamp::adamw_: its arguments checked once and packed into an AdamWCall for the kernel of
// the call's device.
#include "ops/adamw.h"

#include "common/inputs.h"
#include "common/registry.h"

namespace fusedamp {
namespace {

void adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
            at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
            at::TensorList steps, double lr, const c10::optional<at::Tensor>& lr_tensor,
            double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
            bool maximize, const c10::optional<at::Tensor>& inv_grad_scale,
            const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& clip_coef,
            bool write_unscaled_grads) {
  const char* op = AdamWCall::kOp;
  const OptimizerLists lists = check_optimizer_lists(
      op, params, grads,
      {{exp_avgs, "exp_avgs", true}, {exp_avg_sqs, "exp_avg_sqs", true},
       {max_exp_avg_sqs, "max_exp_avg_sqs", amsgrad}},
      masters, steps, step_writes_grads(write_unscaled_grads, inv_grad_scale, clip_coef));
  AdamWCall call{lists.device, lists.param_dtype, lists.grad_dtype, lists.master_kind, {},
                 {beta1, beta2, eps, weight_decay, amsgrad, maximize},
                 check_step_inputs(op, lists.device, lr, lr_tensor, inv_grad_scale, found_inf,
                                   clip_coef, write_unscaled_grads)};
  for (auto [value, name] : {std::pair{beta1, "beta1"}, {beta2, "beta2"}, {eps, "eps"},
                             {weight_decay, "weight_decay"}}) {
    check_hyperparameter(value, name, op);
  }
  if (params.empty()) return;
  const size_t count = params.size();
  call.lists.numels = numels_of(params);
  call.lists.pointers[kAdamWParam] = data_pointers(params, count);
  call.lists.pointers[kAdamWGrad] = data_pointers(grads, count);
  call.lists.pointers[kAdamWMaster] = data_pointers(masters, count);
  call.lists.pointers[kAdamWExpAvg] = data_pointers(exp_avgs, count);
  call.lists.pointers[kAdamWExpAvgSq] = data_pointers(exp_avg_sqs, count);
  call.lists.pointers[kAdamWMaxExpAvgSq] = data_pointers(amsgrad ? max_exp_avg_sqs : at::TensorList(), count);
  call.lists.pointers[kAdamWStep] = data_pointers(steps, count);
  run_kernel(call);
}

}  // namespace

FUSEDAMP_IMPL("adamw_", &adamw_)

}  // namespace fusedamp

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
            bool write_unscaled_grads, const c10::optional<at::TensorList>& exp_avg_scales,
            const c10::optional<at::TensorList>& exp_avg_sq_scales,
            const c10::optional<at::TensorList>& max_exp_avg_sq_scales,
            const c10::optional<at::IntArrayRef>& rounding_ids, int64_t rounding_seed,
            bool stochastic_params) {
  const char* op = AdamWCall::kOp;
  const StateCodec codec = state_codec_of(op, exp_avgs, "exp_avgs");
  const at::ScalarType state_type = codec_dtype(codec);
  const std::vector<StateList> states = {{exp_avgs, "exp_avgs", true, state_type},
                                         {exp_avg_sqs, "exp_avg_sqs", true, state_type},
                                         {max_exp_avg_sqs, "max_exp_avg_sqs", amsgrad, state_type}};
  const bool grads_written = step_writes_grads(write_unscaled_grads, inv_grad_scale, clip_coef);
  const OptimizerLists lists =
      check_optimizer_lists(op, params, grads, states, masters, steps, grads_written);
  auto list_or_empty = [](const c10::optional<at::TensorList>& list) {
    return list ? *list : at::TensorList();
  };
  const std::vector<StateList> scales = {
      {list_or_empty(exp_avg_scales), "exp_avg_scales", true},
      {list_or_empty(exp_avg_sq_scales), "exp_avg_sq_scales", true},
      {list_or_empty(max_exp_avg_sq_scales), "max_exp_avg_sq_scales", amsgrad}};
  if (codec == StateCodec::kInt8 || !scales[0].tensors.empty() || !scales[1].tensors.empty() ||
      !scales[2].tensors.empty()) {
    check_state_scales(op, codec, params, states, scales,
                       {{params, "params"}, {grads, "grads", true, !grads_written},
                        {masters, "masters"}, {steps, "steps"}});
  }
  const std::vector<int64_t> ids = check_rounding_ids(op, lists, params.size(), rounding_ids, stochastic_params);
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
  call.state_codec = codec;
  if (codec == StateCodec::kInt8) {
    call.lists.pointers[kAdamWExpAvgScale] = data_pointers(scales[0].tensors, count);
    call.lists.pointers[kAdamWExpAvgSqScale] = data_pointers(scales[1].tensors, count);
    call.lists.pointers[kAdamWMaxExpAvgSqScale] =
        data_pointers(amsgrad ? scales[2].tensors : at::TensorList(), count);
  } else {
    for (int list : {kAdamWExpAvgScale, kAdamWExpAvgSqScale, kAdamWMaxExpAvgSqScale}) {
      call.lists.pointers[list] = data_pointers(at::TensorList(), count);
    }
  }
  call.rounding = {stochastic_params, uint64_t(rounding_seed)};
  call.lists.pointers[kAdamWRoundingId] = std::vector<void*>(count, nullptr);
  for (size_t i = 0; i < count; ++i) {
    call.lists.pointers[kAdamWRoundingId][i] = rounding_id_as_pointer(ids[i]);
  }
  run_kernel(call);
}

}  // namespace

FUSEDAMP_IMPL("adamw_", &adamw_)

}  // namespace fusedamp

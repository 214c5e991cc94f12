// fusedamp::sgd_: its arguments checked once and packed into an SgdCall for the kernel of the
// call's device.
#include "ops/sgd.h"

#include "common/inputs.h"
#include "common/registry.h"

namespace fusedamp {
namespace {

void sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
          at::TensorList masters, at::TensorList steps, double lr,
          const c10::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
          double weight_decay, bool nesterov, bool maximize,
          const c10::optional<at::Tensor>& inv_grad_scale,
          const c10::optional<at::Tensor>& found_inf, const c10::optional<at::Tensor>& clip_coef,
          bool write_unscaled_grads, const c10::optional<at::TensorList>& momentum_buffer_scales,
          const c10::optional<at::IntArrayRef>& rounding_ids, int64_t rounding_seed,
          bool stochastic_params) {
  const char* op = SgdCall::kOp;
  const StateCodec codec = state_codec_of(op, momentum_buffers, "momentum_buffers");
  const std::vector<StateList> states = {
      {momentum_buffers, "momentum_buffers", momentum != 0.0, codec_dtype(codec)}};
  const bool grads_written = step_writes_grads(write_unscaled_grads, inv_grad_scale, clip_coef);
  const OptimizerLists lists =
      check_optimizer_lists(op, params, grads, states, masters, steps, grads_written);
  const std::vector<StateList> scales = {
      {momentum_buffer_scales ? *momentum_buffer_scales : at::TensorList(), "momentum_buffer_scales",
       true}};
  if (codec == StateCodec::kInt8 || !scales[0].tensors.empty()) {
    check_state_scales(op, codec, params, states, scales,
                       {{params, "params"}, {grads, "grads", true, !grads_written},
                        {masters, "masters"}, {steps, "steps"}});
  }
  const std::vector<int64_t> ids = check_rounding_ids(op, lists, params.size(), rounding_ids, stochastic_params);
  SgdCall call{lists.device, lists.param_dtype, lists.grad_dtype, lists.master_kind, {},
               {momentum, dampening, weight_decay, nesterov, maximize},
               check_step_inputs(op, lists.device, lr, lr_tensor, inv_grad_scale, found_inf,
                                 clip_coef, write_unscaled_grads)};
  for (auto [value, name] : {std::pair{momentum, "momentum"}, {dampening, "dampening"},
                             {weight_decay, "weight_decay"}}) {
    check_hyperparameter(value, name, op);
  }
  if (params.empty()) return;
  const size_t count = params.size();
  call.lists.numels = numels_of(params);
  call.lists.pointers[kSgdParam] = data_pointers(params, count);
  call.lists.pointers[kSgdGrad] = data_pointers(grads, count);
  call.lists.pointers[kSgdMaster] = data_pointers(masters, count);
  call.lists.pointers[kSgdMomentumBuffer] =
      data_pointers(momentum != 0.0 ? momentum_buffers : at::TensorList(), count);
  call.lists.pointers[kSgdStep] = data_pointers(steps, count);
  call.state_codec = codec;
  call.lists.pointers[kSgdMomentumBufferScale] = data_pointers(
      codec == StateCodec::kInt8 && momentum != 0.0 ? scales[0].tensors : at::TensorList(), count);
  call.rounding = {stochastic_params, uint64_t(rounding_seed)};
  call.lists.pointers[kSgdRoundingId] = std::vector<void*>(count, nullptr);
  for (size_t i = 0; i < count; ++i) {
    call.lists.pointers[kSgdRoundingId][i] = rounding_id_as_pointer(ids[i]);
  }
  run_kernel(call);
}

}  // namespace

FUSEDAMP_IMPL("sgd_", &sgd_)

}  // namespace fusedamp

// fusedamp::muon_momentum_: its arguments checked once and packed into a MuonCall for the kernel
// of the call's device.
#include "ops/muon.h"

#include "common/inputs.h"
#include "common/registry.h"

namespace fusedamp {
namespace {

void muon_momentum_(at::TensorList updates, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList steps, double momentum, bool nesterov,
                    const c10::optional<at::Tensor>& inv_grad_scale,
                    const c10::optional<at::Tensor>& found_inf,
                    const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads,
                    const c10::optional<at::TensorList>& momentum_buffer_scales,
                    const c10::optional<at::IntArrayRef>& rounding_ids, int64_t rounding_seed) {
  const char* op = MuonCall::kOp;
  const StateCodec codec = state_codec_of(op, momentum_buffers, "momentum_buffers");
  const std::vector<StateList> states = {{momentum_buffers, "momentum_buffers", true, codec_dtype(codec)}};
  const bool grads_written = step_writes_grads(write_unscaled_grads, inv_grad_scale, clip_coef);
  const OptimizerLists lists =
      check_optimizer_lists(op, updates, grads, states, at::TensorList(), steps, grads_written);
  TORCH_CHECK_TYPE(updates.empty() || lists.param_dtype == DType::kFloat32 ||
                       lists.param_dtype == DType::kBFloat16,
                   "fusedamp: ", op, ": updates must be float32 or bfloat16 (the orthogonalization's "
                   "dtype), got ", updates.empty() ? at::kFloat : updates[0].scalar_type());
  const std::vector<StateList> scales = {
      {momentum_buffer_scales ? *momentum_buffer_scales : at::TensorList(), "momentum_buffer_scales",
       true}};
  if (codec == StateCodec::kInt8 || !scales[0].tensors.empty()) {
    check_state_scales(op, codec, updates, states, scales,
                       {{updates, "updates"}, {grads, "grads", true, !grads_written}, {steps, "steps", true, true}});
  }
  const std::vector<int64_t> ids = check_rounding_ids(op, lists, updates.size(), rounding_ids, false);
  MuonCall call{lists.device, lists.param_dtype, lists.grad_dtype, lists.master_kind, {},
                {momentum, nesterov},
                check_step_inputs(op, lists.device, 0.0, c10::nullopt, inv_grad_scale, found_inf,
                                  clip_coef, write_unscaled_grads)};
  check_hyperparameter(momentum, "momentum", op);
  if (updates.empty()) return;
  const size_t count = updates.size();
  call.lists.numels = numels_of(updates);
  call.lists.pointers[kMuonUpdate] = data_pointers(updates, count);
  call.lists.pointers[kMuonGrad] = data_pointers(grads, count);
  call.lists.pointers[kMuonMaster] = data_pointers(at::TensorList(), count);
  call.lists.pointers[kMuonMomentumBuffer] = data_pointers(momentum_buffers, count);
  call.lists.pointers[kMuonStep] = data_pointers(steps, count);
  call.state_codec = codec;
  call.lists.pointers[kMuonMomentumBufferScale] =
      data_pointers(codec == StateCodec::kInt8 ? scales[0].tensors : at::TensorList(), count);
  call.rounding = {false, uint64_t(rounding_seed)};
  call.lists.pointers[kMuonRoundingId] = std::vector<void*>(count, nullptr);
  for (size_t i = 0; i < count; ++i) {
    call.lists.pointers[kMuonRoundingId][i] = rounding_id_as_pointer(ids[i]);
  }
  run_kernel(call);
}

}  // namespace

FUSEDAMP_IMPL("muon_momentum_", &muon_momentum_)

}  // namespace fusedamp

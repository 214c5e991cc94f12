// Argument validation of fusedamp::grad_stats (see grad_stats_inputs.h).
#include "grad_stats_inputs.h"

#include "inputs.h"

namespace fusedamp {

GradStatsCall check_grad_stats_call(at::TensorList grads, const c10::optional<at::Tensor>& inv_scale) {
  GradStatsCall call{{}, {}, grads.empty() ? (inv_scale ? inv_scale->device() : at::Device(at::kCPU))
                                           : grads[0].device()};
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& grad = grads[i];
    const std::string what = "grad_stats: grads[" + std::to_string(i) + "]";
    TORCH_CHECK(grad.layout() == at::kStrided, "fusedamp: ", what, " has layout ", grad.layout(),
                "; only dense (strided) tensors are supported");
    TORCH_CHECK(grad.device() == call.device, "fusedamp: ", what, " is on ", grad.device(),
                ", expected ", call.device, " like grads[0]");
    TORCH_CHECK(grad.is_non_overlapping_and_dense(), "fusedamp: ", what,
                " is a strided view with gaps or overlaps; pass .contiguous() tensors");
    call.dtypes.push_back(float_dtype_of(grad, what));
    call.numels.push_back(grad.numel());
  }
  if (inv_scale) check_scalar_tensor(*inv_scale, "grad_stats: inv_scale", call.device);
  return call;
}

}  // namespace fusedamp

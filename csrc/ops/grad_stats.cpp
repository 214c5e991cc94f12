// fusedamp::grad_stats: its arguments checked once, its outputs made, and a GradStatsCall
// handed to the kernel of the call's device.
#include "ops/grad_stats.h"

#include <ATen/ops/empty.h>

#include "common/inputs.h"
#include "common/registry.h"

namespace fusedamp {
namespace {

std::tuple<at::Tensor, at::Tensor> grad_stats(at::TensorList grads,
                                              const c10::optional<at::Tensor>& inv_scale) {
  const char* op = GradStatsCall::kOp;
  const at::Device device = !grads.empty() ? grads[0].device()
                            : inv_scale    ? inv_scale->device()
                                           : at::Device(at::kCPU);
  std::vector<DType> dtypes = check_grad_list(grads, op, device);
  if (inv_scale) check_scalar_tensor(*inv_scale, {op, "inv_scale"}, device);
  const int64_t count = int64_t(grads.size());
  const auto on_device = at::TensorOptions().device(device);
  at::Tensor counts = at::empty({count, kGradStatsCounts}, on_device.dtype(at::kLong));
  at::Tensor max_abs = at::empty({count}, on_device.dtype(at::kFloat));
  TensorLists<1> lists;
  lists.pointers[0] = data_pointers(grads, grads.size());
  lists.numels = numels_of(grads);
  if (count > 0) {
    run_kernel(GradStatsCall{device, std::move(lists), std::move(dtypes), optional_scalar(inv_scale),
                             counts.data_ptr<int64_t>(), max_abs.data_ptr<float>()});
  }
  return {counts, max_abs};
}

}  // namespace

FUSEDAMP_IMPL("grad_stats", &grad_stats)

}  // namespace fusedamp

// The AMP gradient ops unscale_, check_and_norm_ and update_scale_: arguments checked once and
// packed into their call structs for the kernel of the call's device.
#include "ops/amp.h"

#include "common/inputs.h"
#include "common/registry.h"

namespace fusedamp {
namespace {

TensorLists<1> grad_lists(at::TensorList grads) {
  TensorLists<1> lists;
  lists.pointers[0] = data_pointers(grads, grads.size());
  lists.numels = numels_of(grads);
  return lists;
}

void unscale_(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const char* op = UnscaleCall::kOp;
  const at::Device device = found_inf.device();
  check_scalar_tensor(found_inf, {op, "found_inf"}, device);
  std::vector<DType> dtypes = check_grad_list(grads, op, device);
  check_scalar_tensor(inv_scale, {op, "inv_scale"}, device);
  check_no_shared_memory(op, {{grads, "grads"}, {found_inf, "found_inf", false},
                              {inv_scale, "inv_scale", false}});
  run_kernel(UnscaleCall{device, grad_lists(grads), std::move(dtypes), found_inf.data_ptr<float>(),
                         inv_scale.const_data_ptr<float>()});
}

void check_and_norm_(at::TensorList grads, const at::Tensor& found_inf,
                     const c10::optional<at::Tensor>& sum_of_squares,
                     const c10::optional<at::Tensor>& inv_scale) {
  const char* op = CheckAndNormCall::kOp;
  const at::Device device = found_inf.device();
  check_scalar_tensor(found_inf, {op, "found_inf"}, device);
  std::vector<DType> dtypes = check_grad_list(grads, op, device);
  if (sum_of_squares) check_scalar_tensor(*sum_of_squares, {op, "sum_of_squares"}, device);
  if (inv_scale) check_scalar_tensor(*inv_scale, {op, "inv_scale"}, device);
  // found_inf and sum_of_squares are written while the grads (and inv_scale) are read: grads
  // may share memory (two params with one grad tensor), as torch's clip_grad_norm_ takes them.
  std::vector<NamedTensors> arguments = {{grads, "grads", true, true}, {found_inf, "found_inf", false}};
  if (sum_of_squares) arguments.push_back({*sum_of_squares, "sum_of_squares", false});
  if (inv_scale) arguments.push_back({*inv_scale, "inv_scale", false});
  check_no_shared_memory(op, arguments);
  run_kernel(CheckAndNormCall{device, grad_lists(grads), std::move(dtypes),
                              found_inf.data_ptr<float>(),
                              sum_of_squares ? sum_of_squares->data_ptr<float>() : nullptr,
                              optional_scalar(inv_scale)});
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval,
                   int64_t hysteresis, double min_scale, double max_scale) {
  const char* op = UpdateScaleCall::kOp;
  const at::Device device = scale.device();
  check_scalar_tensor(scale, {op, "scale"}, device);
  check_scalar_tensor(found_inf, {op, "found_inf"}, device);
  for (const auto& [tracker, name] : {std::pair{&growth_tracker, "growth_tracker"},
                                      std::pair{&hysteresis_tracker, "hysteresis_tracker"}}) {
    TORCH_CHECK_TYPE(tracker->scalar_type() == at::kInt && tracker->numel() == 1, "fusedamp: ", op,
                     ": ", name, " must be a one-element int32 tensor, got ",
                     tracker->scalar_type(), " of shape ", tracker->sizes());
    TORCH_CHECK(tracker->device() == device, "fusedamp: ", op, ": ", name, " is on ",
                tracker->device(), " but scale is on ", device, "; move it there");
  }
  TORCH_CHECK_VALUE(growth_interval > 0 && hysteresis > 0, "fusedamp: ", op, ": growth_interval "
                    "and hysteresis must be positive, got ", growth_interval, " and ", hysteresis);
  for (auto [value, name] : {std::pair{growth_factor, "growth_factor"}, {backoff_factor, "backoff_factor"}}) {
    check_hyperparameter(value, name, op);
    TORCH_CHECK_VALUE(value > 0.0, "fusedamp: ", op, ": ", name, " is ", value, "; it must be positive");
  }
  TORCH_CHECK_VALUE(min_scale <= max_scale, "fusedamp: ", op, ": min_scale (", min_scale,
                    ") must not exceed max_scale (", max_scale, ")");
  check_no_shared_memory(op, {{scale, "scale", false}, {growth_tracker, "growth_tracker", false},
                              {hysteresis_tracker, "hysteresis_tracker", false},
                              {found_inf, "found_inf", false}});
  const LossScaleConfig config{growth_factor, backoff_factor, int32_t(growth_interval),
                               int32_t(hysteresis), float(min_scale), float(max_scale)};
  run_kernel(UpdateScaleCall{device, scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                             hysteresis_tracker.data_ptr<int32_t>(),
                             found_inf.const_data_ptr<float>(), config});
}

}  // namespace

FUSEDAMP_IMPL("unscale_", &unscale_)
FUSEDAMP_IMPL("check_and_norm_", &check_and_norm_)
FUSEDAMP_IMPL("update_scale_", &update_scale_)

}  // namespace fusedamp

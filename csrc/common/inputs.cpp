// Argument validation shared by the CPU and CUDA backends (see inputs.h).
#include "inputs.h"

#include <algorithm>
#include <cmath>

namespace fusedamp {

// fp32 / fp16 / bf16 -> DType in `out`; false for any other type.
static bool to_float_dtype(at::ScalarType type, DType& out) {
  switch (type) {
    case at::kFloat: out = DType::kFloat32; return true;
    case at::kHalf: out = DType::kFloat16; return true;
    case at::kBFloat16: out = DType::kBFloat16; return true;
    default: return false;
  }
}

DType float_dtype_of(const at::Tensor& tensor, const std::string& what) {
  DType dtype;
  TORCH_CHECK_TYPE(to_float_dtype(tensor.scalar_type(), dtype), "fusedamp: ", what, " has dtype ",
                   tensor.scalar_type(), "; expected float32, float16 or bfloat16");
  return dtype;
}

void check_scalar_tensor(const at::Tensor& tensor, const char* what, const at::Device& device) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kFloat, "fusedamp: ", what,
                   " must be a float32 tensor, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.numel() == 1, "fusedamp: ", what,
              " must hold exactly one element, got shape ", tensor.sizes());
  TORCH_CHECK(tensor.device() == device, "fusedamp: ", what, " is on ", tensor.device(),
              " but the tensors it applies to are on ", device);
}

// [note: dense layouts] The kernels walk every tensor linearly over its storage. That is right
// for any layout without gaps or overlaps (contiguous, channels_last, any permutation of the
// dims), provided the tensors an optimizer combines element by element store their elements in
// the same order: the same strides on every dim longer than 1.
static bool is_dense(const at::Tensor& tensor) {
  return tensor.layout() == at::kStrided &&
         (tensor.is_contiguous() || tensor.is_non_overlapping_and_dense());
}

static bool same_element_order(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

static void check_dense_tensor(const at::Tensor& tensor, const std::string& what,
                               const at::Device& device) {
  TORCH_CHECK(tensor.layout() == at::kStrided, "fusedamp: ", what, " has layout ",
              tensor.layout(), "; only dense (strided) tensors are supported");
  TORCH_CHECK(tensor.device() == device, "fusedamp: ", what, " is on ", tensor.device(),
              ", expected ", device, " like the rest of the list");
  TORCH_CHECK(is_dense(tensor), "fusedamp: ", what, " has gaps or overlaps in memory (sizes ",
              tensor.sizes(), ", strides ", tensor.strides(), "); pass a dense tensor, e.g. "
              "tensor.contiguous() (fused kernels walk memory linearly)");
}

static bool is_dense_on(const at::Tensor& tensor, const at::Device& device) {
  return tensor.device() == device && is_dense(tensor);
}

static bool is_scalar_on(const at::Tensor& tensor, const at::Device& device) {
  return tensor.scalar_type() == at::kFloat && tensor.numel() == 1 && tensor.device() == device;
}

static std::string item_name(const char* list, size_t index) {
  return std::string(list) + "[" + std::to_string(index) + "]";
}

void check_grad_list(at::TensorList grads, const at::Tensor& found_inf, const char* op) {
  const at::Device device = found_inf.device();
  check_scalar_tensor(found_inf, (std::string(op) + ": found_inf").c_str(), device);
  for (size_t i = 0; i < grads.size(); ++i) {
    DType dtype;
    if (to_float_dtype(grads[i].scalar_type(), dtype) && is_dense_on(grads[i], device)) {
      continue;  // see [note: lazy names]
    }
    const std::string what = std::string(op) + ": " + item_name("grads", i);
    check_dense_tensor(grads[i], what, device);
    float_dtype_of(grads[i], what);
  }
}

void check_hyperparameter(double value, const char* name, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(value), "fusedamp: ", op, ": ", name, " is ", value,
                    "; it must be a finite number");
}

// Two tensors an op writes (or one it writes and one it reads) must not share memory: the
// kernels would read values they already changed (a grad that is also its param, the same grad
// twice in an unscale_ list). Byte ranges of every non-empty tensor, sorted, checked pairwise
// with their neighbours; density (checked before) makes each tensor one range.
struct MemoryRange {
  uintptr_t begin;
  uintptr_t end;
  const char* list;
  size_t index;
};

static void check_no_shared_memory(const char* op,
                                   const std::vector<std::pair<at::TensorList, const char*>>& lists) {
  std::vector<MemoryRange> ranges;
  for (const auto& [tensors, name] : lists) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(tensors[i].data_ptr());
      ranges.push_back({begin, begin + tensors[i].nbytes(), name, i});
    }
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const MemoryRange& a, const MemoryRange& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < ranges.size(); ++k) {
    const MemoryRange& first = ranges[k - 1];
    const MemoryRange& second = ranges[k];
    TORCH_CHECK(second.begin >= first.end, "fusedamp: ", op, ": ", first.list, "[", first.index,
                "] and ", second.list, "[", second.index, "] share memory; every tensor an op "
                "updates must have its own storage (pass distinct tensors, e.g. .clone())");
  }
}

OptimizerCall check_optimizer_call(const char* op, at::TensorList params, at::TensorList grads,
                                   const std::vector<StateList>& states, at::TensorList masters,
                                   at::TensorList steps,
                                   const c10::optional<at::Tensor>& lr_tensor,
                                   const c10::optional<at::Tensor>& inv_grad_scale,
                                   const c10::optional<at::Tensor>& found_inf,
                                   const c10::optional<at::Tensor>& clip_coef) {
  const std::string prefix = std::string(op) + ": ";
  const size_t count = params.size();
  auto check_length = [&](at::TensorList list, const char* name) {
    TORCH_CHECK(list.size() == count, "fusedamp: ", prefix, name, " has ", list.size(),
                " tensors but params has ", count, "; pass one per param");
  };
  check_length(grads, "grads");
  check_length(steps, "steps");
  for (const StateList& state : states) {
    if (state.required || !state.tensors.empty()) check_length(state.tensors, state.name);
  }
  TORCH_CHECK(masters.empty() || masters.size() == count, "fusedamp: ", prefix, "masters has ",
              masters.size(), " tensors but params has ", count,
              "; pass none (no master weights) or one per param");

  OptimizerCall call{DType::kFloat32, DType::kFloat32, MasterKind::kNone,
                     count ? params[0].device() : at::Device(at::kCPU)};
  if (count == 0) return call;
  call.param_dtype = float_dtype_of(params[0], prefix + "params[0]");
  call.grad_dtype = float_dtype_of(grads[0], prefix + "grads[0]");
  if (!masters.empty()) {
    const bool remainder = masters[0].scalar_type() == at::kShort;
    TORCH_CHECK_TYPE(remainder || masters[0].scalar_type() == at::kFloat, "fusedamp: ", prefix,
                     "masters must be float32 (full master weights) or int16 (bf16 remainders), "
                     "got ", masters[0].scalar_type());
    TORCH_CHECK_TYPE(call.param_dtype != DType::kFloat32, "fusedamp: ", prefix,
                     "float32 params need no master weights; pass an empty masters list");
    TORCH_CHECK_TYPE(!remainder || call.param_dtype == DType::kBFloat16, "fusedamp: ", prefix,
                     "int16 remainder masters need bfloat16 params, got ",
                     params[0].scalar_type());
    call.master_kind = remainder ? MasterKind::kRemainder : MasterKind::kFloat32;
  }

  // [note: lazy names] Each tensor is first checked with plain comparisons; only a tensor that
  // fails gets the descriptive checks, whose names cost a string each: a call over thousands of
  // small tensors must not pay for messages it never prints.
  const at::ScalarType param_type = params[0].scalar_type();
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    auto companion_ok = [&](const at::Tensor& t, at::ScalarType dtype) {
      return is_dense_on(t, call.device) && t.scalar_type() == dtype &&
             t.numel() == param.numel() && same_element_order(t, param);
    };
    bool ok = is_dense_on(param, call.device) && param.scalar_type() == param_type &&
              companion_ok(grads[i], grads[0].scalar_type()) && is_scalar_on(steps[i], call.device) &&
              (masters.empty() || companion_ok(masters[i], masters[0].scalar_type()));
    for (const StateList& state : states) {
      ok = ok && (state.tensors.empty() || companion_ok(state.tensors[i], at::kFloat));
    }
    if (ok) continue;
    const std::string param_name = prefix + item_name("params", i);
    check_dense_tensor(param, param_name, call.device);
    TORCH_CHECK_TYPE(param.scalar_type() == param_type, "fusedamp: ", param_name,
                     " is ", param.scalar_type(), " but params[0] is ", param_type,
                     "; one call takes one param dtype (the optimizers group by dtype)");
    auto check_companion = [&](const at::Tensor& t, const std::string& name, at::ScalarType dtype) {
      check_dense_tensor(t, name, call.device);
      TORCH_CHECK_TYPE(t.scalar_type() == dtype, "fusedamp: ", name, " is ", t.scalar_type(),
                       ", expected ", dtype);
      TORCH_CHECK(t.numel() == param.numel(), "fusedamp: ", name, " has ", t.numel(),
                  " elements but ", param_name, " has ", param.numel());
      TORCH_CHECK(same_element_order(t, param), "fusedamp: ", name, " (sizes ", t.sizes(),
                  ", strides ", t.strides(), ") does not store its elements in the order of ",
                  param_name, " (sizes ", param.sizes(), ", strides ", param.strides(),
                  "); make it in the param's memory format, e.g. torch.empty_like(param, "
                  "dtype=...).copy_(tensor)");
    };
    check_companion(grads[i], prefix + item_name("grads", i), grads[0].scalar_type());
    for (const StateList& state : states) {
      if (!state.tensors.empty()) {
        check_companion(state.tensors[i], prefix + item_name(state.name, i), at::kFloat);
      }
    }
    if (!masters.empty()) {
      check_companion(masters[i], prefix + item_name("masters", i), masters[0].scalar_type());
    }
    check_scalar_tensor(steps[i], (prefix + item_name("steps", i)).c_str(), call.device);
  }
  if (lr_tensor.has_value()) {
    // A CPU lr is read on the host, so it may drive a CUDA step without a sync.
    const at::Device lr_device = lr_tensor->is_cpu() ? lr_tensor->device() : call.device;
    check_scalar_tensor(*lr_tensor, (prefix + "lr_tensor").c_str(), lr_device);
  }
  if (inv_grad_scale.has_value()) {
    check_scalar_tensor(*inv_grad_scale, (prefix + "inv_grad_scale").c_str(), call.device);
  }
  if (found_inf.has_value()) {
    check_scalar_tensor(*found_inf, (prefix + "found_inf").c_str(), call.device);
  }
  if (clip_coef.has_value()) {
    check_scalar_tensor(*clip_coef, (prefix + "clip_coef").c_str(), call.device);
  }
  std::vector<std::pair<at::TensorList, const char*>> updated = {
      {params, "params"}, {grads, "grads"}, {masters, "masters"}, {steps, "steps"}};
  for (const StateList& state : states) updated.emplace_back(state.tensors, state.name);
  check_no_shared_memory(op, updated);
  return call;
}

void check_unscale_args(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_grad_list(grads, found_inf, "unscale_");
  check_no_shared_memory("unscale_", {{grads, "grads"}});
  check_scalar_tensor(inv_scale, "unscale_: inv_scale", found_inf.device());
}

void check_check_and_norm_args(at::TensorList grads, const at::Tensor& found_inf,
                               const c10::optional<at::Tensor>& sum_of_squares,
                               const c10::optional<at::Tensor>& inv_scale) {
  check_grad_list(grads, found_inf, "check_and_norm_");
  if (sum_of_squares) {
    check_scalar_tensor(*sum_of_squares, "check_and_norm_: sum_of_squares", found_inf.device());
  }
  if (inv_scale) check_scalar_tensor(*inv_scale, "check_and_norm_: inv_scale", found_inf.device());
}

LossScaleConfig check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& hysteresis_tracker,
                                        const at::Tensor& found_inf, double growth_factor,
                                        double backoff_factor, int64_t growth_interval,
                                        int64_t hysteresis, double min_scale, double max_scale) {
  check_scalar_tensor(scale, "update_scale_: scale", scale.device());
  check_scalar_tensor(found_inf, "update_scale_: found_inf", scale.device());
  for (const auto& [tracker, name] : {std::pair{&growth_tracker, "growth_tracker"},
                                      std::pair{&hysteresis_tracker, "hysteresis_tracker"}}) {
    TORCH_CHECK_TYPE(tracker->scalar_type() == at::kInt && tracker->numel() == 1, "fusedamp: ",
                     "update_scale_: ", name, " must be a one-element int32 tensor, got ",
                     tracker->scalar_type(), " of shape ", tracker->sizes());
    TORCH_CHECK(tracker->device() == scale.device(), "fusedamp: update_scale_: ", name, " is on ",
                tracker->device(), " but scale is on ", scale.device(), "; move it there");
  }
  TORCH_CHECK_VALUE(growth_interval > 0 && hysteresis > 0, "fusedamp: update_scale_: ",
                    "growth_interval and hysteresis must be positive, got ", growth_interval,
                    " and ", hysteresis);
  return {growth_factor, backoff_factor, int32_t(growth_interval),
          int32_t(hysteresis), float(min_scale), float(max_scale)};
}

OptimizerCall check_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                               at::TensorList masters, at::TensorList steps, double lr,
                               const c10::optional<at::Tensor>& lr_tensor, double beta1,
                               double beta2, double eps, double weight_decay, bool amsgrad,
                               const c10::optional<at::Tensor>& inv_grad_scale,
                               const c10::optional<at::Tensor>& found_inf,
                               const c10::optional<at::Tensor>& clip_coef) {
  const OptimizerCall call = check_optimizer_call(
      "adamw_", params, grads,
      {{exp_avgs, "exp_avgs", true}, {exp_avg_sqs, "exp_avg_sqs", true},
       {max_exp_avg_sqs, "max_exp_avg_sqs", amsgrad}},
      masters, steps, lr_tensor, inv_grad_scale, found_inf, clip_coef);
  for (auto [value, name] : {std::pair{lr, "lr"}, {beta1, "beta1"}, {beta2, "beta2"},
                             {eps, "eps"}, {weight_decay, "weight_decay"}}) {
    check_hyperparameter(value, name, "adamw_");
  }
  return call;
}

OptimizerCall check_sgd_args(at::TensorList params, at::TensorList grads,
                             at::TensorList momentum_buffers, at::TensorList masters,
                             at::TensorList steps, double lr,
                             const c10::optional<at::Tensor>& lr_tensor, double momentum,
                             double dampening, double weight_decay,
                             const c10::optional<at::Tensor>& inv_grad_scale,
                             const c10::optional<at::Tensor>& found_inf,
                             const c10::optional<at::Tensor>& clip_coef) {
  const OptimizerCall call = check_optimizer_call(
      "sgd_", params, grads, {{momentum_buffers, "momentum_buffers", momentum != 0.0}}, masters,
      steps, lr_tensor, inv_grad_scale, found_inf, clip_coef);
  for (auto [value, name] : {std::pair{lr, "lr"}, {momentum, "momentum"},
                             {dampening, "dampening"}, {weight_decay, "weight_decay"}}) {
    check_hyperparameter(value, name, "sgd_");
  }
  return call;
}

GradStatsCall check_grad_stats_call(at::TensorList grads, const c10::optional<at::Tensor>& inv_scale) {
  GradStatsCall call{{}, {}, grads.empty() ? (inv_scale ? inv_scale->device() : at::Device(at::kCPU))
                                           : grads[0].device()};
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& grad = grads[i];
    DType dtype;
    if (!(to_float_dtype(grad.scalar_type(), dtype) && is_dense_on(grad, call.device))) {
      const std::string what = "grad_stats: " + item_name("grads", i);  // [note: lazy names]
      check_dense_tensor(grad, what, call.device);
      dtype = float_dtype_of(grad, what);
    }
    call.dtypes.push_back(dtype);
    call.numels.push_back(grad.numel());
  }
  if (inv_scale) check_scalar_tensor(*inv_scale, "grad_stats: inv_scale", call.device);
  return call;
}

}  // namespace fusedamp

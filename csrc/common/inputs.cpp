// The argument rules the ops share (see inputs.h): each rule is one TORCH_CHECK.
#include "inputs.h"

#include <algorithm>
#include <cmath>

#include "fusedamp/dispatch.h"

namespace fusedamp {

std::ostream& operator<<(std::ostream& out, const ArgName& name) {
  if (name.op != nullptr) out << name.op << ": ";
  out << name.arg;
  if (name.index >= 0) out << "[" << name.index << "]";
  return out;
}

static bool to_float_dtype(at::ScalarType type, DType& out) {
  switch (type) {
    case at::kFloat: out = DType::kFloat32; return true;
    case at::kHalf: out = DType::kFloat16; return true;
    case at::kBFloat16: out = DType::kBFloat16; return true;
    default: return false;
  }
}

DType float_dtype_of(const at::Tensor& tensor, const ArgName& name) {
  DType dtype = DType::kFloat32;
  TORCH_CHECK_TYPE(to_float_dtype(tensor.scalar_type(), dtype), "fusedamp: ", name, " has dtype ",
                   tensor.scalar_type(), "; expected float32, float16 or bfloat16");
  return dtype;
}

void check_scalar_tensor(const at::Tensor& tensor, const ArgName& name, const at::Device& device) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kFloat, "fusedamp: ", name,
                   " must be a float32 tensor, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.numel() == 1, "fusedamp: ", name, " must hold exactly one element, got shape ",
              tensor.sizes());
  TORCH_CHECK(tensor.device() == device, "fusedamp: ", name, " is on ", tensor.device(),
              " but the tensors it applies to are on ", device);
}

// [note: dense layouts] The kernels walk every tensor linearly over its storage. That is right
// for any layout without gaps or overlaps (contiguous, channels_last, any permutation of the
// dims), provided the tensors an optimizer combines element by element store their elements in
// the same order: the same strides on every dim longer than 1.
void check_dense_on(const at::Tensor& tensor, const ArgName& name, const at::Device& device) {
  TORCH_CHECK(tensor.layout() == at::kStrided, "fusedamp: ", name, " has layout ", tensor.layout(),
              "; only dense (strided) tensors are supported");
  TORCH_CHECK(tensor.device() == device, "fusedamp: ", name, " is on ", tensor.device(),
              ", expected ", device, " like the rest of the list");
  TORCH_CHECK(tensor.is_contiguous() || tensor.is_non_overlapping_and_dense(), "fusedamp: ", name,
              " has gaps or overlaps in memory (sizes ", tensor.sizes(), ", strides ",
              tensor.strides(), "); pass a dense tensor, e.g. tensor.contiguous() (fused kernels "
              "walk memory linearly)");
}

static bool same_element_order(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

void check_hyperparameter(double value, const char* name, const char* op) {
  TORCH_CHECK_VALUE(std::isfinite(value), "fusedamp: ", op, ": ", name, " is ", value,
                    "; it must be a finite number");
}

// Two tensors an op writes (or one it writes and one it reads) must not share memory: the
// kernels would read values they already changed (a grad that is also its param, the same grad
// twice in an unscale_ list). Byte ranges of every non-empty tensor, sorted by their start; each
// range is checked against the furthest-reaching range before it: of any tensor when the range is
// written, of a written tensor when it is only read. Density (checked before) makes each tensor one range.
struct MemoryRange {
  uintptr_t begin;
  uintptr_t end;
  uint32_t argument;  // which of the op's arguments
  uint32_t index;     // which tensor of a list argument
};

// Sorts `ranges` by their start. An optimizer's lists come in long runs of tensors allocated one
// after another, ascending (params, states) or descending (grads, which backward makes from the
// last layer back): merging those runs instead of a general sort took this check from about a
// fifth of a 200-param FusedSGD step's host time to a few percent.
static void sort_by_begin(std::vector<MemoryRange>& ranges) {
  constexpr size_t kMostRuns = 64;  // beyond this the ranges are not in runs: sort them
  const auto before = [](const MemoryRange& a, const MemoryRange& b) { return a.begin < b.begin; };
  const auto first = ranges.begin();
  std::vector<size_t> bounds;  // where each run starts, then the end
  for (size_t start = 0; start < ranges.size() && bounds.size() <= kMostRuns;) {
    size_t stop = start + 1;
    if (stop < ranges.size() && ranges[stop].begin < ranges[start].begin) {
      while (stop < ranges.size() && ranges[stop].begin < ranges[stop - 1].begin) ++stop;
      std::reverse(first + start, first + stop);
    } else {
      while (stop < ranges.size() && ranges[stop].begin >= ranges[stop - 1].begin) ++stop;
    }
    bounds.push_back(start);
    start = stop;
  }
  if (bounds.size() > kMostRuns) {
    std::sort(first, ranges.end(), before);
    return;
  }
  bounds.push_back(ranges.size());
  while (bounds.size() > 2) {  // more than one run: merge neighbouring pairs
    std::vector<size_t> merged;
    const size_t runs = bounds.size() - 1;
    for (size_t run = 0; run < runs; run += 2) {
      merged.push_back(bounds[run]);
      if (run + 1 < runs) {
        std::inplace_merge(first + bounds[run], first + bounds[run + 1], first + bounds[run + 2], before);
      }
    }
    merged.push_back(ranges.size());
    bounds.swap(merged);
  }
}

void check_no_shared_memory(const char* op, const std::vector<NamedTensors>& arguments) {
  size_t count = 0;
  for (const NamedTensors& argument : arguments) count += argument.tensors.size();
  std::vector<MemoryRange> ranges;
  ranges.reserve(count);
  for (size_t a = 0; a < arguments.size(); ++a) {
    const at::TensorList tensors = arguments[a].tensors;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(tensors[i].data_ptr());
      ranges.push_back({begin, begin + tensors[i].nbytes(), uint32_t(a), uint32_t(i)});
    }
  }
  sort_by_begin(ranges);
  const auto name_of = [&](const MemoryRange& range, const char* op_name) {
    const NamedTensors& argument = arguments[range.argument];
    return ArgName{op_name, argument.name, argument.is_list ? int64_t(range.index) : -1};
  };
  const MemoryRange* furthest = nullptr;          // of all ranges so far
  const MemoryRange* furthest_written = nullptr;  // of the written ones
  for (const MemoryRange& range : ranges) {
    const bool read_only = arguments[range.argument].read_only;
    const MemoryRange* clash = read_only ? furthest_written : furthest;
    TORCH_CHECK(clash == nullptr || range.begin >= clash->end, "fusedamp: ", name_of(*clash, op), " and ",
                name_of(range, nullptr), " share memory; every tensor an op updates must have its own storage (pass "
                "distinct tensors, e.g. .clone())");
    if (furthest == nullptr || range.end > furthest->end) furthest = &range;
    if (!read_only && (furthest_written == nullptr || range.end > furthest_written->end)) {
      furthest_written = &range;
    }
  }
}

std::vector<DType> check_grad_list(at::TensorList grads, const char* op, const at::Device& device) {
  std::vector<DType> dtypes;
  dtypes.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const ArgName name{op, "grads", int64_t(i)};
    check_dense_on(grads[i], name, device);
    dtypes.push_back(float_dtype_of(grads[i], name));
  }
  return dtypes;
}

// A tensor that goes element by element with `param`: dense on its device, of `dtype`, with the
// param's element count and element order.
static void check_companion(const at::Tensor& tensor, const ArgName& name, at::ScalarType dtype,
                            const at::Tensor& param, const ArgName& param_name,
                            const at::Device& device) {
  check_dense_on(tensor, name, device);
  TORCH_CHECK_TYPE(tensor.scalar_type() == dtype, "fusedamp: ", name, " is ", tensor.scalar_type(),
                   ", expected ", dtype);
  TORCH_CHECK(tensor.numel() == param.numel(), "fusedamp: ", name, " has ", tensor.numel(),
              " elements but ", param_name, " has ", param.numel());
  TORCH_CHECK(same_element_order(tensor, param), "fusedamp: ", name, " (sizes ", tensor.sizes(),
              ", strides ", tensor.strides(), ") does not store its elements in the order of ",
              param_name, " (sizes ", param.sizes(), ", strides ", param.strides(), "); make it in "
              "the param's memory format, e.g. torch.empty_like(param, dtype=...).copy_(tensor)");
}

OptimizerLists check_optimizer_lists(const char* op, at::TensorList params, at::TensorList grads,
                                     const std::vector<StateList>& states, at::TensorList masters,
                                     at::TensorList steps, bool grads_written) {
  const size_t count = params.size();
  auto check_length = [&](at::TensorList list, const char* name) {
    TORCH_CHECK(list.size() == count, "fusedamp: ", op, ": ", name, " has ", list.size(),
                " tensors but params has ", count, "; pass one per param");
  };
  check_length(grads, "grads");
  check_length(steps, "steps");
  for (const StateList& state : states) {
    if (state.required || !state.tensors.empty()) check_length(state.tensors, state.name);
  }
  TORCH_CHECK(masters.empty() || masters.size() == count, "fusedamp: ", op, ": masters has ",
              masters.size(), " tensors but params has ", count,
              "; pass none (no master weights) or one per param");

  OptimizerLists lists{DType::kFloat32, DType::kFloat32, MasterKind::kNone,
                       count ? params[0].device() : at::Device(at::kCPU)};
  if (count == 0) return lists;
  lists.param_dtype = float_dtype_of(params[0], {op, "params", 0});
  lists.grad_dtype = float_dtype_of(grads[0], {op, "grads", 0});
  TORCH_CHECK_TYPE(steps_grad_type(lists.param_dtype, lists.grad_dtype), "fusedamp: ", op, ": grads are ",
                   grads[0].scalar_type(), " but params ", params[0].scalar_type(),
                   "; pass grads of the params' dtype or float32 (float32 params take grads of any float dtype)");
  if (!masters.empty()) {
    const bool remainder = masters[0].scalar_type() == at::kShort;
    TORCH_CHECK_TYPE(remainder || masters[0].scalar_type() == at::kFloat, "fusedamp: ", op,
                     ": masters must be float32 (full master weights) or int16 (bf16 remainders), "
                     "got ", masters[0].scalar_type());
    TORCH_CHECK_TYPE(lists.param_dtype != DType::kFloat32, "fusedamp: ", op,
                     ": float32 params need no master weights; pass an empty masters list");
    TORCH_CHECK_TYPE(!remainder || lists.param_dtype == DType::kBFloat16, "fusedamp: ", op,
                     ": int16 remainder masters need bfloat16 params, got ", params[0].scalar_type());
    lists.master_kind = remainder ? MasterKind::kRemainder : MasterKind::kFloat32;
  }

  const at::ScalarType param_type = params[0].scalar_type();
  for (size_t i = 0; i < count; ++i) {
    const int64_t index = int64_t(i);
    const at::Tensor& param = params[i];
    const ArgName param_name{op, "params", index};
    check_dense_on(param, param_name, lists.device);
    TORCH_CHECK_TYPE(param.scalar_type() == param_type, "fusedamp: ", param_name, " is ",
                     param.scalar_type(), " but params[0] is ", param_type,
                     "; one call takes one param dtype (the optimizers group by dtype)");
    check_companion(grads[i], {op, "grads", index}, grads[0].scalar_type(), param, param_name,
                    lists.device);
    for (const StateList& state : states) {
      if (!state.tensors.empty()) {
        check_companion(state.tensors[i], {op, state.name, index}, state.dtype, param, param_name,
                        lists.device);
      }
    }
    if (!masters.empty()) {
      check_companion(masters[i], {op, "masters", index}, masters[0].scalar_type(), param,
                      param_name, lists.device);
    }
    check_scalar_tensor(steps[i], {op, "steps", index}, lists.device);
  }
  // Grads the step only reads may share memory (two params with one grad tensor, as torch takes).
  std::vector<NamedTensors> updated = {
      {params, "params"}, {grads, "grads", true, !grads_written}, {masters, "masters"}, {steps, "steps"}};
  for (const StateList& state : states) updated.push_back({state.tensors, state.name});
  check_no_shared_memory(op, updated);
  return lists;
}

StateCodec state_codec_of(const char* op, at::TensorList states, const char* name) {
  if (states.empty()) return StateCodec::kFloat32;
  switch (states[0].scalar_type()) {
    case at::kFloat: return StateCodec::kFloat32;
    case at::kBFloat16: return StateCodec::kBFloat16;
    case at::kByte: return StateCodec::kInt8;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "fusedamp: ", op, ": ", name, "[0] is ", states[0].scalar_type(),
                   "; optimizer states are float32, bfloat16 or uint8 block codes (with scales)");
  return StateCodec::kFloat32;
}

at::ScalarType codec_dtype(StateCodec codec) {
  switch (codec) {
    case StateCodec::kBFloat16: return at::kBFloat16;
    case StateCodec::kInt8: return at::kByte;
    default: return at::kFloat;
  }
}

void check_state_scales(const char* op, StateCodec codec, at::TensorList params,
                        const std::vector<StateList>& states, const std::vector<StateList>& scales,
                        const std::vector<NamedTensors>& others) {
  std::vector<NamedTensors> all = others;
  for (size_t k = 0; k < scales.size(); ++k) {
    const StateList& list = scales[k];
    const bool used = codec == StateCodec::kInt8 && !states[k].tensors.empty();
    if (!used) {
      TORCH_CHECK(list.tensors.empty(), "fusedamp: ", op, ": ", list.name, " given, but ",
                  states[k].name, codec == StateCodec::kInt8 ? " is empty" : " are not uint8 codes",
                  "; scales go with uint8 states only");
      continue;
    }
    TORCH_CHECK(list.tensors.size() == params.size(), "fusedamp: ", op, ": ", list.name, " has ",
                list.tensors.size(), " tensors but params has ", params.size(),
                "; uint8 states need one scale tensor per param");
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& scale = list.tensors[i];
      const ArgName name{op, list.name, int64_t(i)};
      TORCH_CHECK_TYPE(scale.scalar_type() == at::kBFloat16, "fusedamp: ", name, " is ",
                       scale.scalar_type(), ", expected bfloat16 (one scale per block, [note: block codes])");
      TORCH_CHECK(scale.device() == params[i].device(), "fusedamp: ", name, " is on ",
                  scale.device(), ", expected ", params[i].device());
      const int64_t blocks = codec_blocks(params[i].numel());
      TORCH_CHECK(scale.is_contiguous() && scale.numel() == blocks, "fusedamp: ", name,
                  " must be a contiguous tensor of ", blocks, " scales (one per ", kCodecBlock,
                  " elements of params[", i, "]), got shape ", scale.sizes());
    }
    all.push_back({list.tensors, list.name});
  }
  for (const StateList& state : states) all.push_back({state.tensors, state.name});
  check_no_shared_memory(op, all);
}

std::vector<int64_t> check_rounding_ids(const char* op, const OptimizerLists& lists, size_t count,
                                        const c10::optional<at::IntArrayRef>& rounding_ids,
                                        bool stochastic_params) {
  TORCH_CHECK_TYPE(!stochastic_params || (lists.param_dtype != DType::kFloat32 && lists.master_kind == MasterKind::kNone),
                   "fusedamp: ", op, ": stochastic_params is for float16 / bfloat16 params without master "
                   "weights; pass an empty masters list and half params, or stochastic_params=False");
  if (!rounding_ids) {
    std::vector<int64_t> positions(count);
    for (size_t i = 0; i < count; ++i) positions[i] = int64_t(i);
    return positions;
  }
  TORCH_CHECK(rounding_ids->size() == count, "fusedamp: ", op, ": rounding_ids has ",
              rounding_ids->size(), " ids but params has ", count, "; pass one per param or none");
  return rounding_ids->vec();
}

StepInputs check_step_inputs(const char* op, const at::Device& device, double lr,
                             const c10::optional<at::Tensor>& lr_tensor,
                             const c10::optional<at::Tensor>& inv_grad_scale,
                             const c10::optional<at::Tensor>& found_inf,
                             const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads) {
  check_hyperparameter(lr, "lr", op);
  StepInputs inputs{nullptr, nullptr, nullptr, nullptr, lr, false, false};
  if (lr_tensor) {
    // A CPU lr is read on the host, so it may drive a CUDA step without a sync.
    const bool on_host = lr_tensor->is_cpu() && !device.is_cpu();
    check_scalar_tensor(*lr_tensor, {op, "lr_tensor"}, on_host ? lr_tensor->device() : device);
    if (on_host) {
      inputs.host_lr = double(*lr_tensor->const_data_ptr<float>());
      inputs.host_lr_from_tensor = true;
    } else {
      inputs.lr = lr_tensor->const_data_ptr<float>();
    }
  }
  auto device_scalar = [&](const c10::optional<at::Tensor>& tensor, const char* name) -> const float* {
    if (!tensor) return nullptr;
    check_scalar_tensor(*tensor, {op, name}, device);
    return tensor->const_data_ptr<float>();
  };
  inputs.inv_grad_scale = device_scalar(inv_grad_scale, "inv_grad_scale");
  inputs.found_inf = device_scalar(found_inf, "found_inf");
  inputs.clip_coef = device_scalar(clip_coef, "clip_coef");
  inputs.write_grad = step_writes_grads(write_unscaled_grads, inv_grad_scale, clip_coef);
  return inputs;
}

bool step_writes_grads(bool write_unscaled_grads, const c10::optional<at::Tensor>& inv_grad_scale,
                       const c10::optional<at::Tensor>& clip_coef) {
  // Writing the grad back costs bandwidth; it is only worth it when the step changed the grad.
  return write_unscaled_grads && (inv_grad_scale.has_value() || clip_coef.has_value());
}

}  // namespace fusedamp

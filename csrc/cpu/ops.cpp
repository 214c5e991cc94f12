// CPU backend of the fusedamp ops: checks (common/inputs.h), chunking (multi_tensor_plan.h),
// at::parallel_for over the chunks, and the per-chunk kernels of the ISA chosen at run time.
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>

#include "common/inputs.h"
#include "cpu/kernels.h"
#include "fusedamp/math/master.h"
#include "fusedamp/math/scale.h"
#include "fusedamp/multi_tensor_plan.h"

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "fusedamp: torch runs at::parallel_for through OpenMP; build with -fopenmp, or every CPU kernel runs on one thread"
#endif

namespace fusedamp::cpu {
namespace {

// Elements per parallel task: large enough to amortize scheduling, small enough that a few
// hundred mid-sized tensors still spread over every core.
constexpr int64_t kChunkSize = 1 << 15;

bool cpu_has(const char* feature_set) {
#if defined(__x86_64__)
  const std::string isa(feature_set);
  __builtin_cpu_init();
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return std::string(feature_set) == "baseline";
}

const KernelTable* table_for(const std::string& isa) {
  if (isa == "avx512") return &kAvx512Kernels;
  if (isa == "avx2") return &kAvx2Kernels;
  if (isa == "baseline") return &kBaselineKernels;
  return nullptr;
}

const KernelTable* checked_table(const std::string& isa) {
  const KernelTable* table = table_for(isa);
  TORCH_CHECK_VALUE(table != nullptr, "fusedamp: unknown CPU ISA '", isa,
                    "'; choose avx512, avx2 or baseline");
  TORCH_CHECK_VALUE(cpu_has(isa.c_str()), "fusedamp: this CPU does not support the '", isa,
                    "' kernels");
  return table;
}

const KernelTable* detect_table() {
  if (const char* forced = std::getenv("FUSEDAMP_CPU_ISA")) {
    if (*forced) return checked_table(forced);
  }
  for (const char* isa : {"avx512", "avx2"}) {
    if (cpu_has(isa)) return table_for(isa);
  }
  return &kBaselineKernels;
}

std::atomic<const KernelTable*>& active_table() {
  static std::atomic<const KernelTable*> table{detect_table()};
  return table;
}

std::vector<int64_t> numels_of(at::TensorList tensors) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const at::Tensor& t : tensors) numels.push_back(t.numel());
  return numels;
}

// Runs body(task_index, tensor_index, begin, end) for every chunk. Threads take chunks one at a
// time from a shared counter instead of a fixed share each: tails and small tensors make chunks
// uneven, and on a shared machine a thread that is descheduled for a while must not hold back
// the work it has not started (the running threads take it). A call with under two chunks of
// elements runs inline: waking the other threads would cost more than it saves.
template <typename Body>
void for_each_chunk(const std::vector<ChunkTask>& tasks, const std::vector<int64_t>& numels,
                    Body&& body) {
  auto run = [&](int64_t k) {
    const ChunkTask& task = tasks[k];
    const int64_t begin = task.chunk * kChunkSize;
    const int64_t end = std::min(numels[task.tensor], begin + kChunkSize);
    body(k, task.tensor, begin, end);
  };
  const int64_t count = int64_t(tasks.size());
  int64_t elements = 0;
  for (const int64_t numel : numels) elements += numel;
  if (elements < 2 * kChunkSize || at::get_num_threads() == 1) {
    for (int64_t k = 0; k < count; ++k) run(k);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1); k < count; k = next.fetch_add(1)) run(k);
  });
}

float read_scalar(const at::Tensor& t) { return *t.data_ptr<float>(); }

void unscale_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(grads, found_inf, inv_scale);
  const float inv = read_scalar(inv_scale);
  const KernelTable& table = kernels();
  const std::vector<int64_t> numels = numels_of(grads);
  std::vector<DType> dtypes;
  for (const at::Tensor& g : grads) dtypes.push_back(float_dtype_of(g, "unscale_: grad"));
  std::atomic<bool> found{false};
  for_each_chunk(plan_chunks(numels, kChunkSize), numels, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    if (table.unscale(grads[t].data_ptr(), dtypes[t], b, e, inv)) found.store(true);
  });
  if (found.load()) found_inf.fill_(1.0);
}

void check_and_norm_cpu(at::TensorList grads, const at::Tensor& found_inf,
                        const c10::optional<at::Tensor>& sum_of_squares,
                        const c10::optional<at::Tensor>& inv_scale) {
  check_check_and_norm_args(grads, found_inf, sum_of_squares, inv_scale);
  const float multiplier = inv_scale ? read_scalar(*inv_scale) : 1.0f;
  const KernelTable& table = kernels();
  const std::vector<int64_t> numels = numels_of(grads);
  const std::vector<ChunkTask> tasks = plan_chunks(numels, kChunkSize);
  std::vector<DType> dtypes;
  for (const at::Tensor& g : grads) dtypes.push_back(float_dtype_of(g, "check_and_norm_: grad"));
  // One partial sum per chunk, added in chunk order: the result does not depend on threads.
  std::vector<float> partial(tasks.size(), 0.0f);
  std::atomic<bool> found{false};
  for_each_chunk(tasks, numels, [&](int64_t k, int64_t t, int64_t b, int64_t e) {
    if (table.check(grads[t].const_data_ptr(), dtypes[t], b, e, multiplier, &partial[k])) {
      found.store(true);
    }
  });
  if (found.load()) found_inf.fill_(1.0);
  if (sum_of_squares) {
    double total = 0.0;
    for (float p : partial) total += p;
    sum_of_squares->add_(total);
  }
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval,
                      int64_t hysteresis, double min_scale, double max_scale) {
  const LossScaleConfig config = check_update_scale_args(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale);
  update_loss_scale(*scale.data_ptr<float>(), *growth_tracker.data_ptr<int32_t>(),
                    *hysteresis_tracker.data_ptr<int32_t>(), read_scalar(found_inf), config);
}

// What every optimizer step on CPU shares: skip on found_inf, the grad multiplier, the lr.
struct StepScalars {
  bool skip;
  float grad_multiplier;
  bool write_grad;
  double lr;
};

StepScalars step_scalars(double lr, const c10::optional<at::Tensor>& lr_tensor,
                         const c10::optional<at::Tensor>& inv_grad_scale,
                         const c10::optional<at::Tensor>& found_inf,
                         const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads) {
  StepScalars s;
  s.skip = found_inf && found_non_finite(read_scalar(*found_inf));
  s.grad_multiplier = (inv_grad_scale ? read_scalar(*inv_grad_scale) : 1.0f) *
                      (clip_coef ? read_scalar(*clip_coef) : 1.0f);
  s.write_grad = step_writes_grad(write_unscaled_grads, inv_grad_scale, clip_coef);
  s.lr = lr_tensor ? double(read_scalar(*lr_tensor)) : lr;
  return s;
}

void* optional_ptr(at::TensorList list, size_t i) { return list.empty() ? nullptr : list[i].data_ptr(); }

void adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
               at::TensorList steps, double lr, const c10::optional<at::Tensor>& lr_tensor,
               double beta1, double beta2, double eps, double weight_decay, bool amsgrad,
               bool maximize, const c10::optional<at::Tensor>& inv_grad_scale,
               const c10::optional<at::Tensor>& found_inf,
               const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads) {
  const OptimizerCall call = check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                              masters, steps, lr, lr_tensor, beta1, beta2, eps,
                                              weight_decay, amsgrad, inv_grad_scale, found_inf,
                                              clip_coef);
  const StepScalars s = step_scalars(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef, write_unscaled_grads);
  if (s.skip || params.empty()) return;

  const size_t count = params.size();
  std::vector<AdamWTensorPointers> pointers(count);
  std::vector<AdamWKernelArgs> args(count);
  for (size_t i = 0; i < count; ++i) {
    pointers[i] = {params[i].data_ptr(), grads[i].data_ptr(), optional_ptr(masters, i),
                   exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                   static_cast<float*>(optional_ptr(max_exp_avg_sqs, i))};
    const double step = double(read_scalar(steps[i])) + 1.0;
    args[i] = {call.param_dtype, call.grad_dtype, call.master_kind,
               adamw_coefficients(s.lr, beta1, beta2, eps, weight_decay, maximize, step),
               s.grad_multiplier, s.write_grad, amsgrad};
  }
  const KernelTable& table = kernels();
  const std::vector<int64_t> numels = numels_of(params);
  for_each_chunk(plan_chunks(numels, kChunkSize), numels, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    table.adamw(pointers[t], args[t], b, e);
  });
  for (const at::Tensor& step : steps) *step.data_ptr<float>() += 1.0f;
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
             at::TensorList masters, at::TensorList steps, double lr,
             const c10::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
             double weight_decay, bool nesterov, bool maximize,
             const c10::optional<at::Tensor>& inv_grad_scale,
             const c10::optional<at::Tensor>& found_inf,
             const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads) {
  const OptimizerCall call = check_sgd_args(params, grads, momentum_buffers, masters, steps, lr,
                                            lr_tensor, momentum, dampening, weight_decay,
                                            inv_grad_scale, found_inf, clip_coef);
  const StepScalars s = step_scalars(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef, write_unscaled_grads);
  if (s.skip || params.empty()) return;

  const size_t count = params.size();
  std::vector<SgdTensorPointers> pointers(count);
  std::vector<SgdKernelArgs> args(count);
  for (size_t i = 0; i < count; ++i) {
    pointers[i] = {params[i].data_ptr(), grads[i].data_ptr(), optional_ptr(masters, i),
                   static_cast<float*>(optional_ptr(momentum_buffers, i))};
    const bool first_step = read_scalar(steps[i]) == 0.0f;
    args[i] = {call.param_dtype, call.grad_dtype, call.master_kind,
               sgd_coefficients(s.lr, momentum, dampening, weight_decay, nesterov, maximize, first_step),
               s.grad_multiplier, s.write_grad};
  }
  const KernelTable& table = kernels();
  const std::vector<int64_t> numels = numels_of(params);
  for_each_chunk(plan_chunks(numels, kChunkSize), numels, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    table.sgd(pointers[t], args[t], b, e);
  });
  for (const at::Tensor& step : steps) *step.data_ptr<float>() += 1.0f;
}

// One pass over a dense tensor's storage (any memory format) with the scalar function of
// math/master.h: this runs once per param when its master state is made, not per step.
std::tuple<at::Tensor, at::Tensor> split_bf16_remainder_cpu(const at::Tensor& master) {
  TORCH_CHECK_TYPE(master.scalar_type() == at::kFloat, "fusedamp: split_bf16_remainder: master "
                   "must be float32, got ", master.scalar_type());
  const at::Tensor source = master.is_non_overlapping_and_dense() ? master : master.contiguous();
  at::Tensor param = at::empty_like(source, source.options().dtype(at::kBFloat16));
  at::Tensor remainder = at::empty_like(source, source.options().dtype(at::kShort));
  const float* in = source.const_data_ptr<float>();
  auto* high = reinterpret_cast<uint16_t*>(param.data_ptr());
  int16_t* low = remainder.data_ptr<int16_t>();
  at::parallel_for(0, source.numel(), kChunkSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) split_bf16_remainder(in[i], high[i], low[i]);
  });
  return {param, remainder};
}

at::Tensor join_bf16_remainder_cpu(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK_TYPE(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort,
                   "fusedamp: join_bf16_remainder: param must be bfloat16 and remainder int16, "
                   "got ", param.scalar_type(), " and ", remainder.scalar_type());
  TORCH_CHECK(param.sizes() == remainder.sizes(), "fusedamp: join_bf16_remainder: param has "
              "shape ", param.sizes(), " but remainder has ", remainder.sizes());
  const at::Tensor high = param.is_non_overlapping_and_dense() ? param : param.contiguous();
  const at::Tensor low = remainder.strides() == high.strides()
                             ? remainder
                             : at::empty_like(high, remainder.options()).copy_(remainder);
  at::Tensor master = at::empty_like(high, high.options().dtype(at::kFloat));
  const auto* in_high = reinterpret_cast<const uint16_t*>(high.const_data_ptr());
  const int16_t* in_low = low.const_data_ptr<int16_t>();
  float* out = master.data_ptr<float>();
  at::parallel_for(0, high.numel(), kChunkSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = join_bf16_remainder(in_high[i], in_low[i]);
  });
  return master;
}

}  // namespace

int64_t parallel_for_threads() {
  std::vector<std::atomic<bool>> used(at::get_num_threads());
  at::parallel_for(0, int64_t(used.size()) * kChunkSize, kChunkSize, [&](int64_t, int64_t) {
    used[at::get_thread_num()].store(true);
  });
  int64_t count = 0;
  for (const auto& flag : used) count += flag.load();
  return count;
}

const KernelTable& kernels() { return *active_table().load(); }

std::string set_kernels_isa(const std::string& isa) {
  const KernelTable* table = checked_table(isa);
  return active_table().exchange(table)->isa;
}

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  m.impl("unscale_", &unscale_cpu);
  m.impl("check_and_norm_", &check_and_norm_cpu);
  m.impl("update_scale_", &update_scale_cpu);
  m.impl("adamw_", &adamw_cpu);
  m.impl("sgd_", &sgd_cpu);
  m.impl("split_bf16_remainder", &split_bf16_remainder_cpu);
  m.impl("join_bf16_remainder", &join_bf16_remainder_cpu);
}

}  // namespace fusedamp::cpu

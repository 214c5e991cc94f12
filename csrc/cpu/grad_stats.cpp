// CPU backend of fusedamp::grad_stats: per-chunk statistics in parallel, merged per tensor in
// chunk order so the result does not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/inputs.h"
#include "fusedamp/math/grad_stats.h"
#include "fusedamp/multi_tensor_plan.h"

namespace fusedamp::cpu {
namespace {

constexpr int64_t kChunkSize = 1 << 15;

template <DType G>
GradStats chunk_stats(const void* data, int64_t begin, int64_t end, float multiplier) {
  const auto* grad = static_cast<const storage_t<G>*>(data);
  GradStats stats;
  for (int64_t i = begin; i < end; ++i) accumulate_grad_stats<G>(grad, i, multiplier, stats);
  return stats;
}

GradStats chunk_stats(const void* data, DType dtype, int64_t begin, int64_t end, float multiplier) {
  switch (dtype) {
    case DType::kFloat16:
      return chunk_stats<DType::kFloat16>(data, begin, end, multiplier);
    case DType::kBFloat16:
      return chunk_stats<DType::kBFloat16>(data, begin, end, multiplier);
    default:
      return chunk_stats<DType::kFloat32>(data, begin, end, multiplier);
  }
}

std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads,
                                                  const c10::optional<at::Tensor>& inv_scale) {
  const GradStatsCall call = check_grad_stats_call(grads, inv_scale);
  const float multiplier = inv_scale ? *inv_scale->data_ptr<float>() : 1.0f;
  const std::vector<ChunkTask> tasks = plan_chunks(call.numels, kChunkSize);
  std::vector<GradStats> partial(tasks.size());
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const ChunkTask& task = tasks[k];
      const int64_t begin = task.chunk * kChunkSize;
      const int64_t end = std::min(call.numels[task.tensor], begin + kChunkSize);
      partial[k] = chunk_stats(grads[task.tensor].const_data_ptr(), call.dtypes[task.tensor],
                               begin, end, multiplier);
    }
  });
  std::vector<GradStats> per_tensor(grads.size());
  for (size_t k = 0; k < tasks.size(); ++k) merge_grad_stats(per_tensor[tasks[k].tensor], partial[k]);

  const int64_t count = int64_t(grads.size());
  at::Tensor counts = at::empty({count, kGradStatsCounts}, at::TensorOptions().dtype(at::kLong));
  at::Tensor max_abs = at::empty({count}, at::TensorOptions().dtype(at::kFloat));
  int64_t* counts_out = counts.data_ptr<int64_t>();
  float* max_out = max_abs.data_ptr<float>();
  for (int64_t t = 0; t < count; ++t) {
    counts_out[t * kGradStatsCounts + 0] = per_tensor[t].below_min_subnormal;
    counts_out[t * kGradStatsCounts + 1] = per_tensor[t].below_min_normal;
    counts_out[t * kGradStatsCounts + 2] = per_tensor[t].non_finite;
    max_out[t] = per_tensor[t].max_abs;
  }
  return {counts, max_abs};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) { m.impl("grad_stats", &grad_stats_cpu); }

}  // namespace fusedamp::cpu

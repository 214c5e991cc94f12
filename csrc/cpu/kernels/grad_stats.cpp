// CPU kernels of grad_stats (built once per ISA, see setup.py): per-chunk statistics over
// math/grad_stats.h, merged per tensor by the driver's per-tensor reduction.
#include "ops/grad_stats.h"

#include "fusedamp/dispatch.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

template <DType G>
GradStats range_stats(const void* data, int64_t begin, int64_t end, float multiplier) {
  const auto* grad = static_cast<const storage_t<G>*>(data);
  GradStats stats;
  for (int64_t i = begin; i < end; ++i) accumulate_grad_stats<G>(grad, i, multiplier, stats);
  return stats;
}

GradStats grad_stats_chunk(const GradStatsCall& call, int64_t tensor, int64_t begin, int64_t end) {
  GradStats stats;
  const float multiplier = call.inv_scale ? *call.inv_scale : 1.0f;
  with_float_dtype(call.dtypes[tensor], [&](auto g) {
    stats = range_stats<g.value>(call.grads.pointers[0][tensor], begin, end, multiplier);
  });
  return stats;
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(GradStatsCall, grad_stats_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void grad_stats_cpu(const GradStatsCall& call) {
  const GradStatsCall::CpuChunk chunk = cpu_chunk<GradStatsCall>();
  const std::vector<GradStats> per_tensor = reduce_per_tensor(
      call.grads.numels, GradStats{},
      [&](int64_t tensor, int64_t begin, int64_t end) { return chunk(call, tensor, begin, end); },
      [](GradStats& into, const GradStats& part) { merge_grad_stats(into, part); });
  for (size_t t = 0; t < per_tensor.size(); ++t) {
    int64_t* counts = call.counts + t * kGradStatsCounts;
    counts[0] = per_tensor[t].below_min_subnormal;
    counts[1] = per_tensor[t].below_min_normal;
    counts[2] = per_tensor[t].non_finite;
    call.max_abs[t] = per_tensor[t].max_abs;
  }
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, GradStatsCall, grad_stats_cpu);
#endif

}  // namespace fusedamp::cpu

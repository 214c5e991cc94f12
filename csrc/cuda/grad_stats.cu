// CUDA kernel of grad_stats: one block per chunk of any grad reduces its chunk to one partial, and
// the launcher's per-tensor reduction merges each grad's partials in block order. No host sync and
// no host buffer (the metadata travels as kernel parameters), so CUDA graphs can capture it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "ops/grad_stats.h"

namespace fusedamp::cuda {
namespace {

struct GradStatsArgs {
  const float* inv_scale;  // null: multiplier 1
  GradStats* partials;     // one per block of the call
};

struct MergeGradStats {
  __device__ GradStats operator()(GradStats into, const GradStats& part) const {
    merge_grad_stats(into, part);
    return into;
  }
};

// Each grad's statistics into its row of counts and its max_abs element.
struct StoreGradStats {
  int64_t* counts;
  float* max_abs;
  __device__ void operator()(int64_t index, const GradStats& stats) const {
    int64_t* row = counts + index * kGradStatsCounts;
    row[0] = stats.below_min_subnormal;
    row[1] = stats.below_min_normal;
    row[2] = stats.non_finite;
    max_abs[index] = stats.max_abs;
  }
};

template <DType G, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    grad_stats_kernel(const __grid_constant__ Meta meta, const GradStatsArgs args) {
  const ChunkLocation chunk = this_chunk(meta);
  const auto* grad = chunk_pointer<const storage_t<G>>(meta, 0, chunk);
  const float multiplier = args.inv_scale ? *args.inv_scale : 1.0f;
  GradStats stats;
  for (int64_t i = threadIdx.x; i < chunk.count; i += kBlockThreads) {
    accumulate_grad_stats<G>(grad, i, multiplier, stats);
  }
  stats = block_reduce(stats, GradStats{}, MergeGradStats{});
  if (threadIdx.x == 0) args.partials[meta.block_offset + blockIdx.x] = stats;
}

void grad_stats_cuda(const GradStatsCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  const std::vector<GradGroup> groups = group_by_dtype(call.grads, call.dtypes);
  const int64_t chunk_size = current_chunk_size();
  int64_t blocks = 0;
  for (const GradGroup& group : groups) blocks += total_chunks(group.numels, chunk_size);
  static_assert(sizeof(GradStats) % sizeof(int64_t) == 0, "GradStats: whole int64 words");
  const at::Tensor partials = at::empty(
      {std::max<int64_t>(blocks, 1) * int64_t(sizeof(GradStats) / sizeof(int64_t))},
      at::TensorOptions().device(call.device).dtype(at::kLong));
  GradStatsArgs args{call.inv_scale, reinterpret_cast<GradStats*>(partials.data_ptr<int64_t>())};
  for (const GradGroup& group : groups) {
    with_float_dtype(group.dtype, [&](auto g) {
      constexpr DType G = decltype(g)::value;
      launch_chunks<list_bit(0)>([](auto meta) { return grad_stats_kernel<G, typename decltype(meta)::type>; },
                                 group.pointers, group.numels, chunk_size, args);
    });
    reduce_per_tensor(args.partials, group.numels, chunk_size, group.indices, GradStats{}, MergeGradStats{},
                      StoreGradStats{call.counts, call.max_abs});
    args.partials += total_chunks(group.numels, chunk_size);
  }
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, GradStatsCall, grad_stats_cuda);

}  // namespace fusedamp::cuda

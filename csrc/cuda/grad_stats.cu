// CUDA backend of fusedamp::grad_stats: one block per chunk of any grad; each block reduces
// its chunk and adds the result to its grad's row with atomics. No host sync, and no host
// buffer either (the metadata travels as kernel parameters), so CUDA graphs can capture it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "common/inputs.h"
#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/grad_stats.h"

namespace fusedamp::cuda {
namespace {

constexpr int kWarps = kBlockThreads / 32;

// The launcher's lists: each grad, and where its statistics go (its row of counts, its
// max_abs_bits element). The output pointers are per tensor, never offset by a chunk.
enum GradStatsList { kGrad, kCounts, kMaxAbsBits, kGradStatsLists };

struct GradStatsArgs {
  const float* inv_scale;  // null: multiplier 1
};

__device__ void warp_reduce(GradStats& stats) {
  for (int offset = 16; offset > 0; offset /= 2) {
    stats.below_min_subnormal += __shfl_down_sync(0xffffffffu, stats.below_min_subnormal, offset);
    stats.below_min_normal += __shfl_down_sync(0xffffffffu, stats.below_min_normal, offset);
    stats.non_finite += __shfl_down_sync(0xffffffffu, stats.non_finite, offset);
    stats.max_abs = fmaxf(stats.max_abs, __shfl_down_sync(0xffffffffu, stats.max_abs, offset));
  }
}

// counts rows: kGradStatsCounts zero-initialized totals. max_abs_bits: the float bits of
// max_abs, zero-initialized; max_abs is never negative, so comparing its bits as unsigned
// integers orders it like floats and atomicMax works on them.
template <DType G>
__global__ void __launch_bounds__(kBlockThreads)
    grad_stats_kernel(const __grid_constant__ ChunkMetadata<kGradStatsLists> meta,
                      const GradStatsArgs args) {
  const ChunkLocation chunk = this_chunk(meta);
  const auto* grad = chunk_pointer<const storage_t<G>>(meta, kGrad, chunk);
  auto* counts = static_cast<unsigned long long*>(meta.pointers[kCounts][chunk.slot]);
  auto* max_abs_bits = static_cast<unsigned int*>(meta.pointers[kMaxAbsBits][chunk.slot]);
  const float multiplier = args.inv_scale ? *args.inv_scale : 1.0f;
  GradStats stats;
  for (int64_t i = threadIdx.x; i < chunk.count; i += kBlockThreads) {
    accumulate_grad_stats<G>(grad, i, multiplier, stats);
  }
  warp_reduce(stats);

  __shared__ long long warp_counts[kGradStatsCounts][kWarps];
  __shared__ float warp_max[kWarps];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    warp_counts[0][warp] = stats.below_min_subnormal;
    warp_counts[1][warp] = stats.below_min_normal;
    warp_counts[2][warp] = stats.non_finite;
    warp_max[warp] = stats.max_abs;
  }
  __syncthreads();
  if (threadIdx.x < kGradStatsCounts) {
    long long total = 0;
    for (int w = 0; w < kWarps; ++w) total += warp_counts[threadIdx.x][w];
    atomicAdd(&counts[threadIdx.x], (unsigned long long)total);
  } else if (threadIdx.x == kGradStatsCounts) {
    float largest = 0.0f;
    for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, warp_max[w]);
    atomicMax(max_abs_bits, __float_as_uint(largest));
  }
}

// The grads of one element type (a kernel instantiation each) with their output pointers.
struct GradStatsGroup {
  DType dtype;
  std::array<std::vector<void*>, kGradStatsLists> pointers;
  std::vector<int64_t> numels;
};

std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads,
                                                   const c10::optional<at::Tensor>& inv_scale) {
  const GradStatsCall call = check_grad_stats_call(grads, inv_scale);
  const c10::cuda::CUDAGuard guard(call.device);
  const int64_t count = int64_t(grads.size());
  const auto on_device = at::TensorOptions().device(call.device);
  at::Tensor counts = at::zeros({count, kGradStatsCounts}, on_device.dtype(at::kLong));
  at::Tensor max_abs_bits = at::zeros({count}, on_device.dtype(at::kInt));
  std::vector<GradStatsGroup> groups;
  for (int64_t t = 0; t < count; ++t) {
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const GradStatsGroup& g) { return g.dtype == call.dtypes[t]; });
    if (group == groups.end()) {
      group = groups.insert(groups.end(), GradStatsGroup{call.dtypes[t], {}, {}});
    }
    group->pointers[kGrad].push_back(const_cast<void*>(grads[t].const_data_ptr()));
    group->pointers[kCounts].push_back(counts.data_ptr<int64_t>() + t * kGradStatsCounts);
    group->pointers[kMaxAbsBits].push_back(max_abs_bits.data_ptr<int32_t>() + t);
    group->numels.push_back(call.numels[t]);
  }
  const GradStatsArgs args{inv_scale ? inv_scale->const_data_ptr<float>() : nullptr};
  for (const GradStatsGroup& group : groups) {
    with_float_dtype(group.dtype, [&](auto g) {
      launch_chunks<kGradStatsLists>(grad_stats_kernel<decltype(g)::value>, group.pointers,
                                     group.numels, args);
    });
  }
  return {counts, max_abs_bits.view(at::kFloat)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl("grad_stats", &grad_stats_cuda); }

}  // namespace fusedamp::cuda

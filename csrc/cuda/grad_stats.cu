// CUDA backend of fusedamp::grad_stats: one block per chunk of any grad; each block reduces
// its chunk and adds the result to its grad's row with atomics. One launch, no host sync.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>

#include "common/grad_stats_inputs.h"
#include "fusedamp/math/grad_stats.h"
#include "fusedamp/multi_tensor_plan.h"

namespace fusedamp::cuda {
namespace {

constexpr int64_t kChunkSize = 1 << 16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// One grad as the kernel sees it.
struct TensorMeta {
  const void* data;
  int64_t numel;
  DType dtype;
};

template <DType G>
__device__ void thread_stats(const void* data, int64_t begin, int64_t end, float multiplier,
                             GradStats& stats) {
  const auto* grad = static_cast<const storage_t<G>*>(data);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    accumulate_grad_stats<G>(grad, i, multiplier, stats);
  }
}

__device__ void warp_reduce(GradStats& stats) {
  for (int offset = 16; offset > 0; offset /= 2) {
    stats.below_min_subnormal += __shfl_down_sync(0xffffffffu, stats.below_min_subnormal, offset);
    stats.below_min_normal += __shfl_down_sync(0xffffffffu, stats.below_min_normal, offset);
    stats.non_finite += __shfl_down_sync(0xffffffffu, stats.non_finite, offset);
    stats.max_abs = fmaxf(stats.max_abs, __shfl_down_sync(0xffffffffu, stats.max_abs, offset));
  }
}

// counts: (num_grads, kGradStatsCounts), zero-initialized. max_abs_bits: the float bits of
// max_abs, zero-initialized; max_abs is never negative, so comparing its bits as unsigned
// integers orders it like floats and atomicMax works on them.
__global__ void __launch_bounds__(kThreads)
grad_stats_kernel(const TensorMeta* tensors, const ChunkTask* tasks, const float* inv_scale,
                  unsigned long long* counts, unsigned int* max_abs_bits) {
  const ChunkTask task = tasks[blockIdx.x];
  const TensorMeta meta = tensors[task.tensor];
  const float multiplier = inv_scale ? *inv_scale : 1.0f;
  const int64_t begin = task.chunk * kChunkSize;
  const int64_t end = min(meta.numel, begin + kChunkSize);
  GradStats stats;
  switch (meta.dtype) {
    case DType::kFloat16:
      thread_stats<DType::kFloat16>(meta.data, begin, end, multiplier, stats);
      break;
    case DType::kBFloat16:
      thread_stats<DType::kBFloat16>(meta.data, begin, end, multiplier, stats);
      break;
    default:
      thread_stats<DType::kFloat32>(meta.data, begin, end, multiplier, stats);
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
    atomicAdd(&counts[task.tensor * kGradStatsCounts + threadIdx.x], (unsigned long long)total);
  } else if (threadIdx.x == kGradStatsCounts) {
    float largest = 0.0f;
    for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, warp_max[w]);
    atomicMax(&max_abs_bits[task.tensor], __float_as_uint(largest));
  }
}

std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads,
                                                   const c10::optional<at::Tensor>& inv_scale) {
  const GradStatsCall call = check_grad_stats_call(grads, inv_scale);
  const c10::cuda::CUDAGuard guard(call.device);
  const int64_t count = int64_t(grads.size());
  const auto on_device = at::TensorOptions().device(call.device);
  at::Tensor counts = at::zeros({count, kGradStatsCounts}, on_device.dtype(at::kLong));
  at::Tensor max_abs_bits = at::zeros({count}, on_device.dtype(at::kInt));
  const std::vector<ChunkTask> tasks = plan_chunks(call.numels, kChunkSize);
  if (!tasks.empty()) {
    // Metadata goes up in one pinned buffer: the TensorMeta array, then the ChunkTask array.
    const size_t meta_bytes = sizeof(TensorMeta) * grads.size();
    const size_t task_offset = (meta_bytes + alignof(ChunkTask) - 1) / alignof(ChunkTask) * alignof(ChunkTask);
    const size_t total_bytes = task_offset + sizeof(ChunkTask) * tasks.size();
    at::Tensor host = at::empty({int64_t(total_bytes)},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* bytes = static_cast<uint8_t*>(host.data_ptr());
    for (int64_t t = 0; t < count; ++t) {
      const TensorMeta meta{grads[t].const_data_ptr(), call.numels[t], call.dtypes[t]};
      std::memcpy(bytes + sizeof(TensorMeta) * t, &meta, sizeof(meta));
    }
    std::memcpy(bytes + task_offset, tasks.data(), sizeof(ChunkTask) * tasks.size());
    const at::Tensor device_meta = host.to(call.device, /*non_blocking=*/true);
    const auto* device_bytes = static_cast<const uint8_t*>(device_meta.const_data_ptr());
    grad_stats_kernel<<<unsigned(tasks.size()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const TensorMeta*>(device_bytes),
        reinterpret_cast<const ChunkTask*>(device_bytes + task_offset),
        inv_scale ? inv_scale->const_data_ptr<float>() : nullptr,
        reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()),
        reinterpret_cast<unsigned int*>(max_abs_bits.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {counts, max_abs_bits.view(at::kFloat)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl("grad_stats", &grad_stats_cuda); }

}  // namespace fusedamp::cuda

// CUDA backend of the AMP gradient ops: unscale_, check_and_norm_ and update_scale_.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "common/inputs.h"
#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/scale.h"
#include "fusedamp/math/unscale.h"

namespace fusedamp::cuda {
namespace {

// Sixteen elements per thread per iteration: two 128-bit loads in flight for 16-bit grads (four
// for fp32), so that even the read-only check keeps enough bytes in flight to saturate HBM; at
// ~32 registers, eight 256-thread blocks fit on an SM.
constexpr int kGradElements = 16;

// Sum over the block in a fixed order (shuffle tree per warp, then the warps in order), so that
// the result is the same run to run. Complete in thread 0 only.
template <typename T>
__device__ T block_sum(T value) {
  constexpr int kWarps = kBlockThreads / 32;
  __shared__ T warp_sums[kWarps];
  const int lane = int(threadIdx.x) % 32;
  const int warp = int(threadIdx.x) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? warp_sums[lane] : T(0);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

struct UnscaleArgs {
  float* found_inf;
  const float* inv_scale;
};

template <DType G>
__global__ void __launch_bounds__(kBlockThreads)
    unscale_kernel(const __grid_constant__ ChunkMetadata<1> meta, const UnscaleArgs args) {
  using Group = ElementGroup<storage_t<G>, kGradElements>;
  const ChunkLocation chunk = this_chunk(meta);
  storage_t<G>* grad = chunk_pointer<storage_t<G>>(meta, 0, chunk);
  const int count = int(chunk.count);
  const float inv_scale = *args.inv_scale;
  bool found = false;
  for_each_group<kGradElements>(count, Group::aligned(grad), [&](int first, bool vector) {
    Group group;
    group.load(grad, first, count, vector);
#pragma unroll
    for (int j = 0; j < kGradElements; ++j) found |= unscale_element<G>(group.values, j, inv_scale);
    group.store(grad, first, count, vector);
  });
  if (__syncthreads_or(found) && threadIdx.x == 0) *args.found_inf = 1.0f;
}

struct CheckArgs {
  float* found_inf;
  const float* inv_scale;  // null: multiplier 1
  float* partial_sums;     // one per block of the call; null: no norm wanted
};

template <DType G>
__global__ void __launch_bounds__(kBlockThreads)
    check_kernel(const __grid_constant__ ChunkMetadata<1> meta, const CheckArgs args) {
  using Group = ElementGroup<storage_t<G>, kGradElements>;
  const ChunkLocation chunk = this_chunk(meta);
  const storage_t<G>* grad = chunk_pointer<storage_t<G>>(meta, 0, chunk);
  const int count = int(chunk.count);
  const float multiplier = args.inv_scale ? *args.inv_scale : 1.0f;
  bool found = false;
  float sum_of_squares = 0.0f;
  for_each_group<kGradElements>(count, Group::aligned(grad), [&](int first, bool vector) {
    Group group;
    group.load(grad, first, count, vector);
    // Skip the zeros past the end: times an infinite multiplier they would add NaN.
#pragma unroll
    for (int j = 0; j < kGradElements; ++j) {
      if (first + j < count) found |= check_element<G>(group.values, j, multiplier, sum_of_squares);
    }
  });
  if (__syncthreads_or(found) && threadIdx.x == 0) *args.found_inf = 1.0f;
  if (args.partial_sums != nullptr) {
    const float block_total = block_sum(sum_of_squares);
    if (threadIdx.x == 0) args.partial_sums[meta.block_offset + blockIdx.x] = block_total;
  }
}

// One block adds the partial sums, in double and in a fixed order, to sum_of_squares: the
// deterministic end of check_and_norm_ (float + float(total), as the CPU backend's add_).
__global__ void __launch_bounds__(kBlockThreads)
    add_partial_sums_kernel(const float* partial_sums, int64_t count, float* sum_of_squares) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kBlockThreads) sum += double(partial_sums[i]);
  const double total = block_sum(sum);
  if (threadIdx.x == 0) *sum_of_squares += float(total);
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_left,
                                    const float* found_inf, const LossScaleConfig config) {
  update_loss_scale(*scale, *growth_tracker, *hysteresis_left, *found_inf, config);
}

// The grads of one element type: a launch (a kernel instantiation) per type in the list.
struct GradGroup {
  DType dtype;
  std::array<std::vector<void*>, 1> pointers;
  std::vector<int64_t> numels;
};

// The grads were checked already: float_dtype_of cannot fail here.
std::vector<GradGroup> group_by_dtype(at::TensorList grads) {
  std::vector<GradGroup> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const DType dtype = float_dtype_of(grads[i], "grads");
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const GradGroup& g) { return g.dtype == dtype; });
    if (group == groups.end()) group = groups.insert(groups.end(), GradGroup{dtype, {}, {}});
    group->pointers[0].push_back(grads[i].data_ptr());
    group->numels.push_back(grads[i].numel());
  }
  return groups;
}

void unscale_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale_args(grads, found_inf, inv_scale);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const UnscaleArgs args{found_inf.data_ptr<float>(), inv_scale.data_ptr<float>()};
  for (const GradGroup& group : group_by_dtype(grads)) {
    with_float_dtype(group.dtype, [&](auto g) {
      launch_chunks<1>(unscale_kernel<decltype(g)::value>, group.pointers, group.numels, args);
    });
  }
}

void check_and_norm_cuda(at::TensorList grads, const at::Tensor& found_inf,
                         const c10::optional<at::Tensor>& sum_of_squares,
                         const c10::optional<at::Tensor>& inv_scale) {
  check_check_and_norm_args(grads, found_inf, sum_of_squares, inv_scale);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const std::vector<GradGroup> groups = group_by_dtype(grads);
  int64_t blocks = 0;
  for (const GradGroup& group : groups) blocks += total_chunks(group.numels);
  at::Tensor partial_sums;
  if (sum_of_squares) partial_sums = at::empty({blocks}, found_inf.options());
  CheckArgs args{found_inf.data_ptr<float>(), inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                 sum_of_squares ? partial_sums.data_ptr<float>() : nullptr};
  for (const GradGroup& group : groups) {
    with_float_dtype(group.dtype, [&](auto g) {
      launch_chunks<1>(check_kernel<decltype(g)::value>, group.pointers, group.numels, args);
    });
    if (args.partial_sums != nullptr) args.partial_sums += total_chunks(group.numels);
  }
  if (sum_of_squares) {
    add_partial_sums_kernel<<<1, kBlockThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        partial_sums.data_ptr<float>(), blocks, sum_of_squares->data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, double min_scale, double max_scale) {
  const LossScaleConfig config = check_update_scale_args(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale);
  const c10::cuda::CUDAGuard guard(scale.device());
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), config);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) {
  m.impl("unscale_", &unscale_cuda);
  m.impl("check_and_norm_", &check_and_norm_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}

}  // namespace fusedamp::cuda

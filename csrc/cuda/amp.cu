// CUDA kernels of the AMP gradient ops: unscale_, check_and_norm_ and update_scale_.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/unscale.h"
#include "ops/amp.h"

namespace fusedamp::cuda {
namespace {

struct UnscaleArgs {
  float* found_inf;
  const float* inv_scale;
};

// The grad ops read one list: the grads.
constexpr uint32_t kGradLists = list_bit(0);

// kUnroll 16-byte pieces per thread and iteration ([note: strided pieces]), a run-time choice.
template <DType G, int kUnroll, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    unscale_kernel(const __grid_constant__ Meta meta, const UnscaleArgs args) {
  using Pieces = StridedPieces<storage_t<G>, kUnroll>;
  const ChunkLocation chunk = this_chunk(meta);
  storage_t<G>* grad = chunk_pointer<storage_t<G>>(meta, 0, chunk);
  const int count = int(chunk.count);
  const float inv_scale = *args.inv_scale;
  bool found = false;
  for_each_iteration<storage_t<G>, kUnroll>(count, Pieces::aligned(grad), [&](int base, bool vector) {
    Pieces pieces;
    pieces.load(grad, base, count, vector);
#pragma unroll
    for (int j = 0; j < Pieces::kValues; ++j) found |= unscale_element<G>(pieces.values, j, inv_scale);
    pieces.store(grad, base, count, vector);
  });
  if (__syncthreads_or(found) && threadIdx.x == 0) *args.found_inf = 1.0f;
}

struct CheckArgs {
  float* found_inf;
  const float* inv_scale;  // null: multiplier 1
  double* partial_sums;    // one per block of the call; null: no norm wanted
};

// The sum of squares adds each thread's elements in its order, then the block's threads and the
// blocks in a fixed order: the same bits run to run for one chunk size and unroll depth.
template <DType G, int kUnroll, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    check_kernel(const __grid_constant__ Meta meta, const CheckArgs args) {
  using Pieces = StridedPieces<storage_t<G>, kUnroll>;
  const ChunkLocation chunk = this_chunk(meta);
  const storage_t<G>* grad = chunk_pointer<storage_t<G>>(meta, 0, chunk);
  const int count = int(chunk.count);
  const float multiplier = args.inv_scale ? *args.inv_scale : 1.0f;
  bool found = false;
  float sum_of_squares = 0.0f;
  for_each_iteration<storage_t<G>, kUnroll>(count, Pieces::aligned(grad), [&](int base, bool vector) {
    Pieces pieces;
    pieces.load(grad, base, count, vector);
    // Skip the zeros past the end: times an infinite multiplier they would add NaN.
#pragma unroll
    for (int j = 0; j < Pieces::kValues; ++j) {
      if (base + Pieces::offset(j) < count) found |= check_element<G>(pieces.values, j, multiplier, sum_of_squares);
    }
  });
  if (__syncthreads_or(found) && threadIdx.x == 0) *args.found_inf = 1.0f;
  if (args.partial_sums != nullptr) {
    const float block_total = block_reduce(sum_of_squares, 0.0f, Sum{});
    if (threadIdx.x == 0) args.partial_sums[meta.block_offset + blockIdx.x] = double(block_total);
  }
}

// check_and_norm_'s total, added to sum_of_squares as float + float(total), as the CPU kernel does.
struct AddToFloat {
  float* target;
  __device__ void operator()(int64_t, double value) const { *target += float(value); }
};

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_left,
                                    const float* found_inf, const LossScaleConfig config) {
  update_loss_scale(*scale, *growth_tracker, *hysteresis_left, *found_inf, config);
}

void unscale_cuda(const UnscaleCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  const UnscaleArgs args{call.found_inf, call.inv_scale};
  const int64_t chunk_size = current_chunk_size();
  for (const GradGroup& group : group_by_dtype(call.grads, call.dtypes)) {
    with_float_dtype(group.dtype, [&](auto g) {
      with_grad_unroll([&](auto unroll) {
        constexpr DType G = decltype(g)::value;
        constexpr int kUnroll = decltype(unroll)::value;
        launch_chunks<kGradLists>(
            [](auto meta) { return unscale_kernel<G, kUnroll, typename decltype(meta)::type>; }, group.pointers,
            group.numels, chunk_size, args);
      });
    });
  }
}

// The grads' blocks write their sums of squares and one reduction adds them all in block order
// (by dtype group, then list order): the per-tensor sums would only feed this total. The norm is
// wanted when the call says so; the partials keep at least one element, as an empty allocation
// has no address and a null pointer tells the kernel "no norm" (with only empty grads no block
// runs, and the reduction of zero partials adds 0).
void check_and_norm_cuda(const CheckAndNormCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  const std::vector<GradGroup> groups = group_by_dtype(call.grads, call.dtypes);
  const int64_t chunk_size = current_chunk_size();
  int64_t blocks = 0;
  for (const GradGroup& group : groups) blocks += total_chunks(group.numels, chunk_size);
  const bool norm = call.sum_of_squares != nullptr;
  at::Tensor partial_sums;
  if (norm) {
    partial_sums = at::empty({std::max<int64_t>(blocks, 1)},
                             at::TensorOptions().device(call.device).dtype(at::kDouble));
  }
  CheckArgs args{call.found_inf, call.inv_scale, norm ? partial_sums.data_ptr<double>() : nullptr};
  for (const GradGroup& group : groups) {
    with_float_dtype(group.dtype, [&](auto g) {
      with_grad_unroll([&](auto unroll) {
        constexpr DType G = decltype(g)::value;
        constexpr int kUnroll = decltype(unroll)::value;
        launch_chunks<kGradLists>(
            [](auto meta) { return check_kernel<G, kUnroll, typename decltype(meta)::type>; }, group.pointers,
            group.numels, chunk_size, args);
      });
    });
    if (norm) args.partial_sums += total_chunks(group.numels, chunk_size);
  }
  if (norm) {
    reduce_segments(partial_sums.const_data_ptr<double>(), {Segment{0, int32_t(blocks), 0}}, 0.0,
                    Sum{}, AddToFloat{call.sum_of_squares});
  }
}

void update_scale_cuda(const UpdateScaleCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      call.scale, call.growth_tracker, call.hysteresis_tracker, call.found_inf, call.config);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, UnscaleCall, unscale_cuda);
FUSEDAMP_REGISTER_KERNEL(CUDA, CheckAndNormCall, check_and_norm_cuda);
FUSEDAMP_REGISTER_KERNEL(CUDA, UpdateScaleCall, update_scale_cuda);

}  // namespace fusedamp::cuda

// CUDA backend of adamw_: one fused pass per chunk over grads, params, masters and moments.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/inputs.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/adamw.h"

namespace fusedamp::cuda {
namespace {

enum AdamWList { kParam, kGrad, kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kStep, kAdamWLists };

struct AdamWArgs {
  StepInputs inputs;
  double beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, write_grad;
};

template <DType P, DType G, MasterKind M>
__global__ void __launch_bounds__(kBlockThreads)
    adamw_kernel(const __grid_constant__ ChunkMetadata<kAdamWLists> meta, const AdamWArgs args) {
  constexpr int E = kOptimizerElements;
  if (step_skipped(args.inputs.found_inf)) return;
  const ChunkLocation chunk = this_chunk(meta);
  // The coefficients need two pows in double: once per block, not per thread.
  __shared__ AdamWCoefficients shared_coefficients;
  if (threadIdx.x == 0) {
    const float step = *static_cast<const float*>(meta.pointers[kStep][chunk.slot]);
    shared_coefficients = adamw_coefficients(step_lr(args.inputs), args.beta1, args.beta2, args.eps,
                                             args.weight_decay, args.maximize, double(step) + 1.0);
  }
  __syncthreads();
  const AdamWCoefficients coefficients = shared_coefficients;
  const float multiplier = grad_multiplier(args.inputs);

  auto* param = chunk_pointer<storage_t<P>>(meta, kParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kMaster, chunk);
  auto* exp_avg = chunk_pointer<float>(meta, kExpAvg, chunk);
  auto* exp_avg_sq = chunk_pointer<float>(meta, kExpAvgSq, chunk);
  auto* max_exp_avg_sq = chunk_pointer<float>(meta, kMaxExpAvgSq, chunk);
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    ElementGroup<float, E> exp_avg_group, exp_avg_sq_group, max_exp_avg_sq_group;
    grad_group.load(grad, first, count, vector);
    // Load what load_master reads and nothing more: a full fp32 master replaces the param.
    if constexpr (M != MasterKind::kFloat32) param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    exp_avg_group.load(exp_avg, first, count, vector);
    exp_avg_sq_group.load(exp_avg_sq, first, count, vector);
    if (args.amsgrad) max_exp_avg_sq_group.load(max_exp_avg_sq, first, count, vector);

    const AdamWTensorPointers registers{param_group.values,   grad_group.values,
                                        master_group.values,  exp_avg_group.values,
                                        exp_avg_sq_group.values, max_exp_avg_sq_group.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      adamw_element<P, G, M>(registers, j, coefficients, multiplier, args.write_grad, args.amsgrad);
    }

    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    exp_avg_group.store(exp_avg, first, count, vector);
    exp_avg_sq_group.store(exp_avg_sq, first, count, vector);
    if (args.amsgrad) max_exp_avg_sq_group.store(max_exp_avg_sq, first, count, vector);
    if (args.write_grad) grad_group.store(grad, first, count, vector);
  });
}

void adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
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
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(call.device);
  const size_t count = params.size();
  std::array<std::vector<void*>, kAdamWLists> pointers;
  pointers[kParam] = data_pointers(params, count);
  pointers[kGrad] = data_pointers(grads, count);
  pointers[kMaster] = data_pointers(masters, count);
  pointers[kExpAvg] = data_pointers(exp_avgs, count);
  pointers[kExpAvgSq] = data_pointers(exp_avg_sqs, count);
  pointers[kMaxExpAvgSq] = data_pointers(amsgrad ? max_exp_avg_sqs : at::TensorList(), count);
  pointers[kStep] = data_pointers(steps, count);
  const AdamWArgs args{step_inputs(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef),
                       beta1, beta2, eps, weight_decay, amsgrad, maximize,
                       step_writes_grad(write_unscaled_grads, inv_grad_scale, clip_coef)};
  const std::vector<int64_t> numels = numels_of(params);
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<decltype(p)::value>(call.master_kind, [&](auto m) {
        launch_chunks<kAdamWLists>(
            adamw_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value>, pointers,
            numels, args);
      });
    });
  });
  increment_steps(steps, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl("adamw_", &adamw_cuda); }

}  // namespace fusedamp::cuda

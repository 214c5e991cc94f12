// CUDA kernel of adamw_: one fused pass per chunk over grads, params, masters and moments.
#include <c10/cuda/CUDAGuard.h>

#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "ops/adamw.h"

namespace fusedamp::cuda {
namespace {

struct AdamWArgs {
  StepInputs inputs;
  AdamWHyperparameters hyper;
};

template <DType P, DType G, MasterKind M>
__global__ void __launch_bounds__(kBlockThreads)
    adamw_kernel(const __grid_constant__ ChunkMetadata<kAdamWLists> meta, const AdamWArgs args) {
  constexpr int E = kOptimizerElements;
  if (step_skipped(args.inputs)) return;
  const ChunkLocation chunk = this_chunk(meta);
  // The coefficients need two pows in double: once per block, not per thread.
  __shared__ AdamWCoefficients shared_coefficients;
  if (threadIdx.x == 0) {
    const float step = *static_cast<const float*>(meta.pointers[kAdamWStep][chunk.slot]);
    const AdamWHyperparameters& h = args.hyper;
    shared_coefficients = adamw_coefficients(step_lr(args.inputs), h.beta1, h.beta2, h.eps,
                                             h.weight_decay, h.maximize, double(step) + 1.0);
  }
  __syncthreads();
  const AdamWCoefficients coefficients = shared_coefficients;
  const float multiplier = grad_multiplier(args.inputs);

  auto* param = chunk_pointer<storage_t<P>>(meta, kAdamWParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kAdamWGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kAdamWMaster, chunk);
  auto* exp_avg = chunk_pointer<float>(meta, kAdamWExpAvg, chunk);
  auto* exp_avg_sq = chunk_pointer<float>(meta, kAdamWExpAvgSq, chunk);
  auto* max_exp_avg_sq = chunk_pointer<float>(meta, kAdamWMaxExpAvgSq, chunk);
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    ElementGroup<float, E> exp_avg_group, exp_avg_sq_group, max_exp_avg_sq_group;
    grad_group.load(grad, first, count, vector);
    // The param even with an fp32 master: load_master compares them ([note: edited params]).
    param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    exp_avg_group.load(exp_avg, first, count, vector);
    exp_avg_sq_group.load(exp_avg_sq, first, count, vector);
    if (args.hyper.amsgrad) max_exp_avg_sq_group.load(max_exp_avg_sq, first, count, vector);

    const AdamWTensorPointers registers{param_group.values,   grad_group.values,
                                        master_group.values,  exp_avg_group.values,
                                        exp_avg_sq_group.values, max_exp_avg_sq_group.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      adamw_element<P, G, M>(registers, j, coefficients, multiplier, args.inputs.write_grad,
                             args.hyper.amsgrad);
    }

    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    exp_avg_group.store(exp_avg, first, count, vector);
    exp_avg_sq_group.store(exp_avg_sq, first, count, vector);
    if (args.hyper.amsgrad) max_exp_avg_sq_group.store(max_exp_avg_sq, first, count, vector);
    if (args.inputs.write_grad) grad_group.store(grad, first, count, vector);
  });
}

void adamw_cuda(const AdamWCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  check_host_lr_not_captured(call.inputs);
  if (call.state_codec != StateCodec::kFloat32 || call.rounding.enabled) {
    adamw_coded_cuda(call);
    increment_steps(call.lists.pointers[kAdamWStep], call.inputs.found_inf);
    return;
  }
  const AdamWArgs args{call.inputs, call.hyper};
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<decltype(p)::value>(call.master_kind, [&](auto m) {
        launch_chunks<kAdamWLists>(
            adamw_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value>,
            call.lists.pointers, call.lists.numels, args);
      });
    });
  });
  increment_steps(call.lists.pointers[kAdamWStep], call.inputs.found_inf);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, AdamWCall, adamw_cuda);

}  // namespace fusedamp::cuda

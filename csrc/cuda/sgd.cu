// CUDA kernel of sgd_: one fused pass per chunk over grads, params, masters and momentum.
#include <c10/cuda/CUDAGuard.h>

#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "ops/sgd.h"

namespace fusedamp::cuda {
namespace {

struct SgdArgs {
  StepInputs inputs;
  SgdHyperparameters hyper;
};

template <DType P, DType G, MasterKind M>
__global__ void __launch_bounds__(kBlockThreads)
    sgd_kernel(const __grid_constant__ ChunkMetadata<kSgdLists> meta, const SgdArgs args) {
  constexpr int E = kOptimizerElements;
  if (step_skipped(args.inputs)) return;
  const ChunkLocation chunk = this_chunk(meta);
  const float step = *static_cast<const float*>(meta.pointers[kSgdStep][chunk.slot]);
  const SgdHyperparameters& h = args.hyper;
  const SgdCoefficients coefficients = sgd_coefficients(
      step_lr(args.inputs), h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize,
      step == 0.0f);
  const float multiplier = grad_multiplier(args.inputs);
  // A buffer exists with momentum; its first step overwrites it without reading it.
  const bool has_buffer = coefficients.momentum != 0.0f;
  const bool reads_buffer = has_buffer && !coefficients.first_step;

  auto* param = chunk_pointer<storage_t<P>>(meta, kSgdParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kSgdGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kSgdMaster, chunk);
  auto* buffer = chunk_pointer<float>(meta, kSgdMomentumBuffer, chunk);
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, buffer);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    ElementGroup<float, E> buffer_group;
    grad_group.load(grad, first, count, vector);
    // The param even with an fp32 master: load_master compares them ([note: edited params]).
    param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    if (reads_buffer) buffer_group.load(buffer, first, count, vector);

    const SgdTensorPointers registers{param_group.values, grad_group.values, master_group.values,
                                      buffer_group.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      sgd_element<P, G, M>(registers, j, coefficients, multiplier, args.inputs.write_grad, has_buffer);
    }

    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    if (has_buffer) buffer_group.store(buffer, first, count, vector);
    if (args.inputs.write_grad) grad_group.store(grad, first, count, vector);
  });
}

void sgd_cuda(const SgdCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  check_host_lr_not_captured(call.inputs);
  if (call.state_codec != StateCodec::kFloat32 || call.rounding.enabled) {
    sgd_coded_cuda(call);
    increment_steps(call.lists.pointers[kSgdStep], call.inputs.found_inf);
    return;
  }
  const SgdArgs args{call.inputs, call.hyper};
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<decltype(p)::value>(call.master_kind, [&](auto m) {
        launch_chunks<kSgdLists>(sgd_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value>,
                                 call.lists.pointers, call.lists.numels, args);
      });
    });
  });
  increment_steps(call.lists.pointers[kSgdStep], call.inputs.found_inf);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, SgdCall, sgd_cuda);

}  // namespace fusedamp::cuda

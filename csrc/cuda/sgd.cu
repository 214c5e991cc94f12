// CUDA backend of sgd_: one fused pass per chunk over grads, params, masters and momentum.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/inputs.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/sgd.h"

namespace fusedamp::cuda {
namespace {

enum SgdList { kParam, kGrad, kMaster, kMomentumBuffer, kStep, kSgdLists };

struct SgdArgs {
  StepInputs inputs;
  double momentum, dampening, weight_decay;
  bool nesterov, maximize, write_grad;
};

template <DType P, DType G, MasterKind M>
__global__ void __launch_bounds__(kBlockThreads)
    sgd_kernel(const __grid_constant__ ChunkMetadata<kSgdLists> meta, const SgdArgs args) {
  constexpr int E = kOptimizerElements;
  if (step_skipped(args.inputs.found_inf)) return;
  const ChunkLocation chunk = this_chunk(meta);
  const float step = *static_cast<const float*>(meta.pointers[kStep][chunk.slot]);
  const SgdCoefficients coefficients =
      sgd_coefficients(step_lr(args.inputs), args.momentum, args.dampening, args.weight_decay,
                       args.nesterov, args.maximize, step == 0.0f);
  const float multiplier = grad_multiplier(args.inputs);
  // A buffer exists with momentum; its first step overwrites it without reading it.
  const bool has_buffer = coefficients.momentum != 0.0f;
  const bool reads_buffer = has_buffer && !coefficients.first_step;

  auto* param = chunk_pointer<storage_t<P>>(meta, kParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kMaster, chunk);
  auto* buffer = chunk_pointer<float>(meta, kMomentumBuffer, chunk);
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, buffer);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    ElementGroup<float, E> buffer_group;
    grad_group.load(grad, first, count, vector);
    // Load what load_master reads and nothing more: a full fp32 master replaces the param.
    if constexpr (M != MasterKind::kFloat32) param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    if (reads_buffer) buffer_group.load(buffer, first, count, vector);

    const SgdTensorPointers registers{param_group.values, grad_group.values, master_group.values,
                                      buffer_group.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      sgd_element<P, G, M>(registers, j, coefficients, multiplier, args.write_grad, has_buffer);
    }

    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    if (has_buffer) buffer_group.store(buffer, first, count, vector);
    if (args.write_grad) grad_group.store(grad, first, count, vector);
  });
}

void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList masters, at::TensorList steps, double lr,
              const c10::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
              double weight_decay, bool nesterov, bool maximize,
              const c10::optional<at::Tensor>& inv_grad_scale,
              const c10::optional<at::Tensor>& found_inf,
              const c10::optional<at::Tensor>& clip_coef, bool write_unscaled_grads) {
  const OptimizerCall call = check_sgd_args(params, grads, momentum_buffers, masters, steps, lr,
                                            lr_tensor, momentum, dampening, weight_decay,
                                            inv_grad_scale, found_inf, clip_coef);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(call.device);
  const size_t count = params.size();
  std::array<std::vector<void*>, kSgdLists> pointers;
  pointers[kParam] = data_pointers(params, count);
  pointers[kGrad] = data_pointers(grads, count);
  pointers[kMaster] = data_pointers(masters, count);
  pointers[kMomentumBuffer] = data_pointers(momentum != 0.0 ? momentum_buffers : at::TensorList(), count);
  pointers[kStep] = data_pointers(steps, count);
  const SgdArgs args{step_inputs(lr, lr_tensor, inv_grad_scale, found_inf, clip_coef), momentum,
                     dampening, weight_decay, nesterov, maximize,
                     step_writes_grad(write_unscaled_grads, inv_grad_scale, clip_coef)};
  const std::vector<int64_t> numels = numels_of(params);
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<decltype(p)::value>(call.master_kind, [&](auto m) {
        launch_chunks<kSgdLists>(sgd_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value>,
                                 pointers, numels, args);
      });
    });
  });
  increment_steps(steps, found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl("sgd_", &sgd_cuda); }

}  // namespace fusedamp::cuda

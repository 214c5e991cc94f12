// CUDA kernel of sgd_: one fused pass per chunk over grads, params, masters and momentum.
#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "ops/sgd.h"

namespace fusedamp::cuda {
namespace {

template <DType P, DType G, MasterKind M, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    sgd_kernel(const __grid_constant__ Meta meta, const StepArgs<SgdCall> args) {
  constexpr int E = kOptimizerElements;
  const auto s = begin_step_chunk<SgdCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  // A buffer exists with momentum; its first step overwrites it without reading it.
  const bool has_buffer = s.coefficients.momentum != 0.0f;
  const bool reads_buffer = has_buffer && !s.coefficients.first_step;

  const auto param_side = param_chunk<SgdCall, P, G, M>(meta, s.chunk);
  auto* buffer = chunk_pointer<float>(meta, kSgdMomentumBuffer, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned = all_aligned<E>(param_side.param, param_side.grad, param_side.master, buffer);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ParamGroups<P, G, M, E> x;
    ElementGroup<float, E> buffer_group;
    x.load(param_side, first, count, vector);
    if (reads_buffer) buffer_group.load(buffer, first, count, vector);

    x.update([&](auto p, auto m, void* param, int j) {
      const SgdTensorPointers registers{param, x.grad.values, x.master.values, buffer_group.values};
      sgd_element<decltype(p)::value, G, decltype(m)::value>(registers, j, s.coefficients, s.multiplier,
                                                             args.inputs.write_grad, has_buffer);
    });

    if (has_buffer) buffer_group.store(buffer, first, count, vector);
    x.store(param_side, first, count, vector, args.inputs.write_grad);
  });
}

void sgd_cuda(const SgdCall& call) {
  const StepArgs<SgdCall> args = step_args(call);
  run_optimizer_step(call, sgd_coded_cuda, [&](auto p, auto g, auto m) {
    constexpr DType P = decltype(p)::value, G = decltype(g)::value;
    constexpr MasterKind M = decltype(m)::value;
    constexpr uint32_t kLists = SgdCall::kernel_lists(M != MasterKind::kNone, StateCodec::kFloat32, false);
    launch_chunks<kLists>([](auto meta) { return sgd_kernel<P, G, M, typename decltype(meta)::type>; },
                          call.lists.pointers, call.lists.numels, current_chunk_size(), args);
  });
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, SgdCall, sgd_cuda);

}  // namespace fusedamp::cuda

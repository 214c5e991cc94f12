// CUDA kernel of adamw_: one fused pass per chunk over grads, params, masters and moments.
#include "common/registry.h"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "ops/adamw.h"

namespace fusedamp::cuda {
namespace {

template <DType P, DType G, MasterKind M, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    adamw_kernel(const __grid_constant__ Meta meta, const StepArgs<AdamWCall> args) {
  constexpr int E = kOptimizerElements;
  const auto s = begin_step_chunk<AdamWCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  const bool amsgrad = args.hyper.amsgrad;
  const auto param_side = param_chunk<AdamWCall, P, G, M>(meta, s.chunk);
  auto* exp_avg = chunk_pointer<float>(meta, kAdamWExpAvg, s.chunk);
  auto* exp_avg_sq = chunk_pointer<float>(meta, kAdamWExpAvgSq, s.chunk);
  auto* max_exp_avg_sq = chunk_pointer<float>(meta, kAdamWMaxExpAvgSq, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned =
      all_aligned<E>(param_side.param, param_side.grad, param_side.master, exp_avg, exp_avg_sq, max_exp_avg_sq);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ParamGroups<P, G, M, E> x;
    ElementGroup<float, E> exp_avg_group, exp_avg_sq_group, max_exp_avg_sq_group;
    x.load(param_side, first, count, vector);
    exp_avg_group.load(exp_avg, first, count, vector);
    exp_avg_sq_group.load(exp_avg_sq, first, count, vector);
    if (amsgrad) max_exp_avg_sq_group.load(max_exp_avg_sq, first, count, vector);

    x.update([&](auto p, auto m, void* param, int j) {
      const AdamWTensorPointers registers{param,
                                          x.grad.values,
                                          x.master.values,
                                          exp_avg_group.values,
                                          exp_avg_sq_group.values,
                                          max_exp_avg_sq_group.values};
      adamw_element<decltype(p)::value, G, decltype(m)::value>(registers, j, s.coefficients, s.multiplier,
                                                               args.inputs.write_grad, amsgrad);
    });

    exp_avg_group.store(exp_avg, first, count, vector);
    exp_avg_sq_group.store(exp_avg_sq, first, count, vector);
    if (amsgrad) max_exp_avg_sq_group.store(max_exp_avg_sq, first, count, vector);
    x.store(param_side, first, count, vector, args.inputs.write_grad);
  });
}

void adamw_cuda(const AdamWCall& call) {
  const StepArgs<AdamWCall> args = step_args(call);
  run_optimizer_step(call, adamw_coded_cuda, [&](auto p, auto g, auto m) {
    constexpr DType P = decltype(p)::value, G = decltype(g)::value;
    constexpr MasterKind M = decltype(m)::value;
    constexpr uint32_t kLists = AdamWCall::kernel_lists(M != MasterKind::kNone, StateCodec::kFloat32, false);
    launch_chunks<kLists>([](auto meta) { return adamw_kernel<P, G, M, typename decltype(meta)::type>; },
                          call.lists.pointers, call.lists.numels, current_chunk_size(), args);
  });
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, AdamWCall, adamw_cuda);

}  // namespace fusedamp::cuda

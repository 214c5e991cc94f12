// CUDA kernel of sgd_ in the coded modes ([note: state codecs]): bf16 or 8-bit momentum buffers,
// and stochastically rounded params, in the same fused pass as cuda/sgd.cu.
#include "cuda/codec.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "ops/sgd.h"

namespace fusedamp::cuda {
namespace {

// kStochastic: as adamw_coded_kernel.
template <DType P, DType G, MasterKind M, StateCodec C, bool kStochastic, int kRuns, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    sgd_coded_kernel(const __grid_constant__ Meta meta, const StepArgs<SgdCall> args) {
  const auto s = begin_step_chunk<SgdCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  const bool has_buffer = s.coefficients.momentum != 0.0f;
  const ChunkKeys keys = s.keys(args.rounding.seed);
  const uint32_t key = kStochastic ? keys.key(RoundingStream::kParam) : 0u;
  // Dithered draws ([note: dithered draws]).
  const uint32_t buffer_key = keys.dither_key(RoundingStream::kState0);
  const uint32_t rotation = keys.rotation();

  const auto param_side = param_chunk<SgdCall, P, G, M>(meta, s.chunk);
  auto* buffer = chunk_pointer<codec_storage_t<C>>(meta, kSgdMomentumBuffer, s.chunk);
  uint16_t* scales = chunk_scales(meta, kSgdMomentumBufferScale, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned = all_aligned<kCodedRun>(param_side.param, param_side.grad, param_side.master, buffer);
  for_each_coded_group<kRuns>(count, [&](int base) {
    StateGroup<C, true, kRuns> buffer_group;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const CodedRun run = CodedLayout<kRuns>::run(base, r, count, aligned);
      ParamGroups<P, G, M, kCodedRun> x;
      x.load(param_side, run.first, count, run.vector);
      if (has_buffer) buffer_group.load(buffer, scales, base, r, count, aligned);
      x.template update<kStochastic>(
          [&](auto p, auto m, void* param, int j) {
            const SgdTensorPointers registers{param, x.grad.values, x.master.values, buffer_group.run_values(r)};
            sgd_element<decltype(p)::value, G, decltype(m)::value>(registers, j, s.coefficients, s.multiplier,
                                                                   args.inputs.write_grad, has_buffer);
          },
          key, s.chunk.begin + run.first);
      x.store(param_side, run.first, count, run.vector, args.inputs.write_grad);
      if (has_buffer) buffer_group.store(buffer, scales, base, r, count, aligned, buffer_key, s.chunk.begin, rotation);
    }
  });
}

}  // namespace

void sgd_coded_cuda(const SgdCall& call) {
  const StepArgs<SgdCall> args = step_args(call);
  with_coded_kernel(call, [&](auto p, auto g, auto m, auto c, auto stochastic, auto runs) {
    constexpr DType P = decltype(p)::value, G = decltype(g)::value;
    constexpr MasterKind M = decltype(m)::value;
    constexpr StateCodec C = decltype(c)::value;
    constexpr bool kStochastic = decltype(stochastic)::value;
    constexpr int kRuns = decltype(runs)::value;
    constexpr uint32_t kLists = SgdCall::kernel_lists(M != MasterKind::kNone, C, true);
    launch_chunks<kLists>(
        [](auto meta) { return sgd_coded_kernel<P, G, M, C, kStochastic, kRuns, typename decltype(meta)::type>; },
        call.lists.pointers, call.lists.numels, current_chunk_size(), args);
  });
}

}  // namespace fusedamp::cuda

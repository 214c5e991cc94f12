// CUDA kernel of adamw_ in the coded modes ([note: state codecs]): bf16 or 8-bit moments, and
// stochastically rounded params, in the same fused pass as cuda/adamw.cu (its own file: the
// instantiations compile in parallel with the plain ones).
#include "cuda/codec.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "ops/adamw.h"

namespace fusedamp::cuda {
namespace {

// The blocks an SM must hold of a kernel of layout kRuns: with two runs 2, so that ptxas gives the
// 8-bit kernels the registers they need (85 to 128) where its own choice, 80, spilled 4 bytes in
// some; with one run none (0: ptxas's own choice; an explicit 1 let it take 66 to 96 registers
// where it chose 48 to 64).
template <int kRuns>
constexpr int kMinBlocks = kRuns == 2 ? 2 : 0;

// kStochastic: half params without masters (M == kNone) take the fp32 update stochastically
// rounded, with the bits of math/stochastic.h; the math then runs on the param as fp32. kRuns: the
// layout of a thread's elements ([note: coded iterations]).
template <DType P, DType G, MasterKind M, StateCodec C, bool kStochastic, int kRuns, typename Meta>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocks<kRuns>)
    adamw_coded_kernel(const __grid_constant__ Meta meta, const StepArgs<AdamWCall> args) {
  using State = codec_storage_t<C>;
  const auto s = begin_step_chunk<AdamWCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  const bool amsgrad = args.hyper.amsgrad;
  const ChunkKeys keys = s.keys(args.rounding.seed);
  const uint32_t key = kStochastic ? keys.key(RoundingStream::kParam) : 0u;
  // Both moments round with the bits of one dithered draw ([note: shared state draws],
  // [note: dithered draws]).
  const uint32_t moments_key = keys.dither_key(RoundingStream::kState0);
  const uint32_t max_exp_avg_sq_key = keys.dither_key(RoundingStream::kState1);
  const uint32_t rotation = keys.rotation();

  const auto param_side = param_chunk<AdamWCall, P, G, M>(meta, s.chunk);
  auto* exp_avg = chunk_pointer<State>(meta, kAdamWExpAvg, s.chunk);
  auto* exp_avg_sq = chunk_pointer<State>(meta, kAdamWExpAvgSq, s.chunk);
  auto* max_exp_avg_sq = chunk_pointer<State>(meta, kAdamWMaxExpAvgSq, s.chunk);
  uint16_t* exp_avg_scales = chunk_scales(meta, kAdamWExpAvgScale, s.chunk);
  uint16_t* exp_avg_sq_scales = chunk_scales(meta, kAdamWExpAvgSqScale, s.chunk);
  uint16_t* max_exp_avg_sq_scales = chunk_scales(meta, kAdamWMaxExpAvgSqScale, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned = all_aligned<kCodedRun>(param_side.param, param_side.grad, param_side.master, exp_avg,
                                              exp_avg_sq, max_exp_avg_sq);
  for_each_coded_group<kRuns>(count, [&](int base) {
    StateGroup<C, true, kRuns, DrawShare::kLow> m;
    StateGroup<C, false, kRuns, DrawShare::kHigh> v;
    StateGroup<C, false, kRuns> v_max;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const CodedRun run = CodedLayout<kRuns>::run(base, r, count, aligned);
      ParamGroups<P, G, M, kCodedRun> x;
      x.load(param_side, run.first, count, run.vector);
      m.load(exp_avg, exp_avg_scales, base, r, count, aligned);
      v.load(exp_avg_sq, exp_avg_sq_scales, base, r, count, aligned);
      if (amsgrad) v_max.load(max_exp_avg_sq, max_exp_avg_sq_scales, base, r, count, aligned);
      x.template update<kStochastic>(
          [&](auto p, auto master, void* param, int j) {
            const AdamWTensorPointers registers{param,           x.grad.values,   x.master.values,
                                                m.run_values(r), v.run_values(r), v_max.run_values(r)};
            adamw_element<decltype(p)::value, G, decltype(master)::value>(
                registers, j, s.coefficients, s.multiplier, args.inputs.write_grad, amsgrad);
          },
          key, s.chunk.begin + run.first);
      // The param side first: its registers are free before the last run encodes the block.
      x.store(param_side, run.first, count, run.vector, args.inputs.write_grad);
      m.store(exp_avg, exp_avg_scales, base, r, count, aligned, moments_key, s.chunk.begin, rotation);
      v.store(exp_avg_sq, exp_avg_sq_scales, base, r, count, aligned, moments_key, s.chunk.begin, rotation);
      if (amsgrad) {
        v_max.store(max_exp_avg_sq, max_exp_avg_sq_scales, base, r, count, aligned, max_exp_avg_sq_key,
                    s.chunk.begin, rotation);
      }
    }
  });
}

}  // namespace

void adamw_coded_cuda(const AdamWCall& call) {
  const StepArgs<AdamWCall> args = step_args(call);
  with_coded_kernel(call, [&](auto p, auto g, auto m, auto c, auto stochastic, auto runs) {
    constexpr DType P = decltype(p)::value, G = decltype(g)::value;
    constexpr MasterKind M = decltype(m)::value;
    constexpr StateCodec C = decltype(c)::value;
    constexpr bool kStochastic = decltype(stochastic)::value;
    constexpr int kRuns = decltype(runs)::value;
    constexpr uint32_t kLists = AdamWCall::kernel_lists(M != MasterKind::kNone, C, true);
    launch_chunks<kLists>(
        [](auto meta) { return adamw_coded_kernel<P, G, M, C, kStochastic, kRuns, typename decltype(meta)::type>; },
        call.lists.pointers, call.lists.numels, current_chunk_size(), args);
  });
}

}  // namespace fusedamp::cuda

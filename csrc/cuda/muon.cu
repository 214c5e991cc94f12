// CUDA kernels of muon_momentum_: one fused pass per chunk over grads, momentum buffers (fp32, or
// through their codec: [note: state codecs]) and the updates it writes.
#include "common/registry.h"
#include "cuda/codec.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "ops/muon.h"

namespace fusedamp::cuda {
namespace {

constexpr MasterKind kNoMaster = MasterKind::kNone;

// The kernels a call can reach: updates in fp32 or bf16, no masters, never stochastic.
template <DType U, MasterKind M>
constexpr bool kMuonTypes = M == kNoMaster && (U == DType::kFloat32 || U == DType::kBFloat16);

template <DType U, DType G, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    muon_kernel(const __grid_constant__ Meta meta, const StepArgs<MuonCall> args) {
  constexpr int E = kOptimizerElements;
  const auto s = begin_step_chunk<MuonCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  const auto update_side = param_chunk<MuonCall, U, G, kNoMaster>(meta, s.chunk);
  auto* buffer = chunk_pointer<float>(meta, kMuonMomentumBuffer, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned = all_aligned<E>(update_side.param, update_side.grad, update_side.master, buffer);
  for_each_group<E>(count, aligned, [&](int first, bool vector) {
    ParamGroups<U, G, kNoMaster, E> x;
    ElementGroup<float, E> buffer_group;
    x.grad.load(update_side.grad, first, count, vector);  // the updates are written, never read
    buffer_group.load(buffer, first, count, vector);
    x.update([&](auto u, auto m, void* update, int j) {
      const MuonTensorPointers registers{update, x.grad.values, nullptr, buffer_group.values};
      muon_element<decltype(u)::value, G, decltype(m)::value>(registers, j, s.coefficients, s.multiplier,
                                                              args.inputs.write_grad);
    });
    buffer_group.store(buffer, first, count, vector);
    x.store(update_side, first, count, vector, args.inputs.write_grad);
  });
}

template <DType U, DType G, StateCodec C, int kRuns, typename Meta>
__global__ void __launch_bounds__(kBlockThreads)
    muon_coded_kernel(const __grid_constant__ Meta meta, const StepArgs<MuonCall> args) {
  const auto s = begin_step_chunk<MuonCall>(meta, args);  // [note: optimizer chunk]
  if (s.skipped) return;
  // The buffer rounds with dithered draws ([note: dithered draws]).
  const ChunkKeys keys = s.keys(args.rounding.seed);
  const uint32_t buffer_key = keys.dither_key(RoundingStream::kState0);
  const uint32_t rotation = keys.rotation();
  const auto update_side = param_chunk<MuonCall, U, G, kNoMaster>(meta, s.chunk);
  auto* buffer = chunk_pointer<codec_storage_t<C>>(meta, kMuonMomentumBuffer, s.chunk);
  uint16_t* scales = chunk_scales(meta, kMuonMomentumBufferScale, s.chunk);
  const int count = int(s.chunk.count);
  const bool aligned = all_aligned<kCodedRun>(update_side.param, update_side.grad, update_side.master, buffer);
  for_each_coded_group<kRuns>(count, [&](int base) {
    StateGroup<C, true, kRuns> buffer_group;
#pragma unroll
    for (int r = 0; r < kRuns; ++r) {
      const CodedRun run = CodedLayout<kRuns>::run(base, r, count, aligned);
      ParamGroups<U, G, kNoMaster, kCodedRun> x;
      x.grad.load(update_side.grad, run.first, count, run.vector);  // the updates are written, never read
      buffer_group.load(buffer, scales, base, r, count, aligned);
      x.update([&](auto u, auto m, void* update, int j) {
        const MuonTensorPointers registers{update, x.grad.values, nullptr, buffer_group.run_values(r)};
        muon_element<decltype(u)::value, G, decltype(m)::value>(registers, j, s.coefficients, s.multiplier,
                                                                args.inputs.write_grad);
      });
      x.store(update_side, run.first, count, run.vector, args.inputs.write_grad);
      buffer_group.store(buffer, scales, base, r, count, aligned, buffer_key, s.chunk.begin, rotation);
    }
  });
}

void muon_coded_cuda(const MuonCall& call) {
  const StepArgs<MuonCall> args = step_args(call);
  with_coded_kernel(call, [&](auto u, auto g, auto m, auto c, auto stochastic, auto runs) {
    if constexpr (kMuonTypes<decltype(u)::value, decltype(m)::value> && !decltype(stochastic)::value) {
      constexpr DType U = decltype(u)::value, G = decltype(g)::value;
      constexpr StateCodec C = decltype(c)::value;
      constexpr int kRuns = decltype(runs)::value;
      constexpr uint32_t kLists = MuonCall::kernel_lists(false, C, true);
      launch_chunks<kLists>([](auto meta) { return muon_coded_kernel<U, G, C, kRuns, typename decltype(meta)::type>; },
                            call.lists.pointers, call.lists.numels, current_chunk_size(), args);
    }
  });
}

void muon_momentum_cuda(const MuonCall& call) {
  const StepArgs<MuonCall> args = step_args(call);
  run_optimizer_step(call, muon_coded_cuda, [&](auto u, auto g, auto m) {
    if constexpr (kMuonTypes<decltype(u)::value, decltype(m)::value>) {
      constexpr DType U = decltype(u)::value, G = decltype(g)::value;
      constexpr uint32_t kLists = MuonCall::kernel_lists(false, StateCodec::kFloat32, false);
      launch_chunks<kLists>([](auto meta) { return muon_kernel<U, G, typename decltype(meta)::type>; },
                            call.lists.pointers, call.lists.numels, current_chunk_size(), args);
    }
  });
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, MuonCall, muon_momentum_cuda);

}  // namespace fusedamp::cuda

// CPU kernels of muon_momentum_ (built once per ISA, see setup.py): the per-chunk loops over
// math/muon.h on the shared optimizer loops of cpu/optimizer.h, and its driver there.
#include "ops/muon.h"

#include "cpu/optimizer.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

// The element loop, as sgd_elements.
template <DType U, DType G, MasterKind M, bool kWriteGrad>
[[gnu::always_inline]] inline void muon_elements(const MuonTensorPointers t, const MuonCoefficients c,
                                                 float multiplier, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    muon_element<U, G, M>(t, i, c, multiplier, kWriteGrad);
  }
}

template <DType U, DType G, bool kWriteGrad>
void muon_range(const MuonTensorPointers& tensor, const MuonCoefficients c, float multiplier, int64_t begin,
                int64_t end) {
  constexpr MasterKind M = MasterKind::kNone;
  auto prefetch = [&](int64_t block) {
    prefetch_ahead<U, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                  tensor.momentum_buffer);
  };
  plain_step_range<U, G, M, kWriteGrad>(
      tensor, begin, end, prefetch, [&](auto u, auto g, auto m, MuonTensorPointers at, int64_t first, auto n) {
        at.momentum_buffer += first;
        muon_elements<u.value, g.value, m.value, kWriteGrad>(at, c, multiplier, 0, n);
      });
}

// [note: block staging] The momentum buffer through the call's state codec, as sgd_block_range.
template <DType U, DType G, StateCodec C, bool kWriteGrad>
void muon_block_range(const MuonCall& call, int64_t tensor, const MuonCoefficients c, float multiplier,
                      int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  const ChunkKeys keys = chunk_keys(call, tensor, begin);
  const StagedParam<U, G, MasterKind::kNone> update = staged_param<U, G, MasterKind::kNone>(call, tensor, keys);
  void* const buffer = lists[kMuonMomentumBuffer][tensor];
  uint16_t* const scales = static_cast<uint16_t*>(lists[kMuonMomentumBufferScale][tensor]);
  // The buffer rounds with dithered draws ([note: dithered draws]).
  StagedState<C, true, DrawShare::kWhole> momentum(buffer, scales, keys.dither_key(RoundingStream::kState0),
                                                   keys.rotation());
  alignas(64) float value_tile[kBlockGroup], grad_tile[kBlockGroup];
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    update.template prefetch<C>(block, end, buffer);
    auto b = momentum.begin_block(block, n);
    for_each_stage_group<kBlockGroup>(block, block + n, [&](int64_t first, auto group) {
      const int64_t offset = first - block;
      const StagedGroup x = update.stage(first, group, value_tile, grad_tile);
      const MuonTensorPointers tile{x.value, x.grad, nullptr, b.stage(offset, group)};
      muon_elements<DType::kFloat32, DType::kFloat32, MasterKind::kNone, kWriteGrad>(tile, c, multiplier, 0,
                                                                                     group);
      b.unstage(offset, group);
      b.encode_pending(offset, group);
      update.template unstage<kWriteGrad>(first, group, x, false);
    });
    momentum.end_block(b, block, n);
  });
  momentum.finish();
}

// Only the kernels a call can reach are built: updates in fp32 or bf16, no masters (the op
// checks both).
template <DType U, MasterKind M>
constexpr bool kMuonTypes = M == MasterKind::kNone && (U == DType::kFloat32 || U == DType::kBFloat16);

void muon_chunk(const MuonCall& call, const MuonCoefficients& coefficients, int64_t tensor, int64_t begin,
                int64_t end) {
  const float multiplier = grad_multiplier(call.inputs);
  dispatch_optimizer_chunk(
      call, {call.inputs.write_grad},
      [&](auto u, auto g, auto m, auto write_grad) {
        if constexpr (kMuonTypes<u.value, m.value>) {
          const auto& lists = call.lists.pointers;
          const MuonTensorPointers pointers{lists[kMuonUpdate][tensor], lists[kMuonGrad][tensor], nullptr,
                                            static_cast<float*>(lists[kMuonMomentumBuffer][tensor])};
          muon_range<u.value, g.value, write_grad.value>(pointers, coefficients, multiplier, begin, end);
        }
      },
      [&](auto u, auto g, auto m, auto codec, auto write_grad) {
        // Coded only for bf16 / int8 buffers: the updates are never rounded stochastically.
        if constexpr (kMuonTypes<u.value, m.value> && codec.value != StateCodec::kFloat32) {
          muon_block_range<u.value, g.value, codec.value, write_grad.value>(call, tensor, coefficients,
                                                                             multiplier, begin, end);
        }
      });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(MuonCall, muon_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void muon_momentum_cpu(const MuonCall& call) { run_optimizer_step(call); }

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, MuonCall, muon_momentum_cpu);
#endif

}  // namespace fusedamp::cpu

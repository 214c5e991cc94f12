// CPU kernels of sgd_ (built once per ISA, see setup.py): the per-chunk loops over math/sgd.h on
// the shared optimizer loops of cpu/optimizer.h, and its driver there.
#include "ops/sgd.h"

#include "cpu/optimizer.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

// The element loop, inlined into both callers below so that a staged group of kStageLanes
// values compiles to straight vector code. The coefficients by value: a reference could alias
// the floats the loop stores, and the compiler would reload them on every element.
template <DType P, DType G, MasterKind M, bool kHasMomentum, bool kWriteGrad>
[[gnu::always_inline]] inline void sgd_elements(const SgdTensorPointers t, const SgdCoefficients c,
                                                float multiplier, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    sgd_element<P, G, M>(t, i, c, multiplier, kWriteGrad, kHasMomentum);
  }
}

template <DType P, DType G, MasterKind M, bool kHasMomentum, bool kWriteGrad>
void sgd_range(const SgdTensorPointers& tensor, const SgdCoefficients c, float multiplier,
               int64_t begin, int64_t end) {
  auto prefetch = [&](int64_t block) {
    if (kHasMomentum) {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.momentum_buffer);
    } else {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad);
    }
  };
  plain_step_range<P, G, M, kWriteGrad>(
      tensor, begin, end, prefetch, [&](auto p, auto g, auto m, SgdTensorPointers at, int64_t first, auto n) {
        if (kHasMomentum) at.momentum_buffer += first;
        sgd_elements<p.value, g.value, m.value, kHasMomentum, kWriteGrad>(at, c, multiplier, 0, n);
      });
}

// [note: block staging] The coded modes, as adamw_block_range: the momentum buffer through the
// call's state codec, the param through its master mode or stochastic rounding.
template <DType P, DType G, MasterKind M, StateCodec C, bool kHasMomentum, bool kWriteGrad>
void sgd_block_range(const SgdCall& call, int64_t tensor, const SgdCoefficients c, float multiplier,
                     int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  const ChunkKeys keys = chunk_keys(call, tensor, begin);
  const StagedParam<P, G, M> param = staged_param<P, G, M>(call, tensor, keys);
  void* const buffer = lists[kSgdMomentumBuffer][tensor];
  // Dithered draws ([note: dithered draws]).
  StagedState<C, true, DrawShare::kWhole> momentum(
      buffer, static_cast<uint16_t*>(lists[kSgdMomentumBufferScale][tensor]), keys.dither_key(RoundingStream::kState0),
      keys.rotation());
  alignas(64) float value_tile[kBlockGroup], grad_tile[kBlockGroup];
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kHasMomentum) {
      param.template prefetch<C>(block, end, buffer);
    } else {
      param.template prefetch<C>(block, end);
    }
    // Without momentum the block stays empty: there is no buffer (nor scales) to read.
    auto b = kHasMomentum ? momentum.begin_block(block, n) : StateBlock<C, true, DrawShare::kWhole>{};
    for_each_stage_group<kBlockGroup>(block, block + n, [&](int64_t first, auto group) {
      const int64_t offset = first - block;
      const StagedGroup x = param.stage(first, group, value_tile, grad_tile);
      const SgdTensorPointers tile{x.value, x.grad, nullptr, kHasMomentum ? b.stage(offset, group) : nullptr};
      sgd_elements<DType::kFloat32, DType::kFloat32, MasterKind::kNone, kHasMomentum, kWriteGrad>(
          tile, c, multiplier, 0, group);
      if (kHasMomentum) {
        b.unstage(offset, group);
        b.encode_pending(offset, group);
      }
      param.template unstage<kWriteGrad>(first, group, x, call.rounding.enabled);
    });
    if (kHasMomentum) momentum.end_block(b, block, n);
  });
  if (kHasMomentum) momentum.finish();
}

void sgd_chunk(const SgdCall& call, const SgdCoefficients& coefficients, int64_t tensor,
               int64_t begin, int64_t end) {
  const float multiplier = grad_multiplier(call.inputs);
  dispatch_optimizer_chunk(
      call, {coefficients.momentum != 0.0f, call.inputs.write_grad},
      [&](auto p, auto g, auto m, auto has_momentum, auto write_grad) {
        const auto& lists = call.lists.pointers;
        const SgdTensorPointers pointers{lists[kSgdParam][tensor], lists[kSgdGrad][tensor],
                                         lists[kSgdMaster][tensor],
                                         static_cast<float*>(lists[kSgdMomentumBuffer][tensor])};
        sgd_range<p.value, g.value, m.value, has_momentum.value, write_grad.value>(pointers, coefficients,
                                                                                   multiplier, begin, end);
      },
      [&](auto p, auto g, auto m, auto codec, auto has_momentum, auto write_grad) {
        sgd_block_range<p.value, g.value, m.value, codec.value, has_momentum.value, write_grad.value>(
            call, tensor, coefficients, multiplier, begin, end);
      });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(SgdCall, sgd_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void sgd_cpu(const SgdCall& call) { run_optimizer_step(call); }

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, SgdCall, sgd_cpu);
#endif

}  // namespace fusedamp::cpu

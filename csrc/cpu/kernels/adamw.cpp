// CPU kernels of adamw_ (built once per ISA, see setup.py): the per-chunk loops over
// math/adamw.h on the shared optimizer loops of cpu/optimizer.h, and its driver there.
#include "ops/adamw.h"

#include "cpu/optimizer.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

// The element loop, inlined into both callers below so that a staged group of kStageLanes
// values compiles to straight vector code (a call per group cost a third of the bf16 step).
// The coefficients by value: a reference could alias the floats the loop stores, and the
// compiler would reload them on every element.
template <DType P, DType G, MasterKind M, bool kAmsgrad, bool kWriteGrad>
[[gnu::always_inline]] inline void adamw_elements(const AdamWTensorPointers t, const AdamWCoefficients c,
                                                  float multiplier, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    adamw_element<P, G, M>(t, i, c, multiplier, kWriteGrad, kAmsgrad);
  }
}

template <DType P, DType G, MasterKind M, bool kAmsgrad, bool kWriteGrad>
void adamw_range(const AdamWTensorPointers& tensor, const AdamWCoefficients c, float multiplier,
                 int64_t begin, int64_t end) {
  auto prefetch = [&](int64_t block) {
    if (kAmsgrad) {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.exp_avg, tensor.exp_avg_sq, tensor.max_exp_avg_sq);
    } else {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.exp_avg, tensor.exp_avg_sq);
    }
  };
  plain_step_range<P, G, M, kWriteGrad>(
      tensor, begin, end, prefetch, [&](auto p, auto g, auto m, AdamWTensorPointers at, int64_t first, auto n) {
        at.exp_avg += first;
        at.exp_avg_sq += first;
        if (kAmsgrad) at.max_exp_avg_sq += first;
        adamw_elements<p.value, g.value, m.value, kAmsgrad, kWriteGrad>(at, c, multiplier, 0, n);
      });
}

// [note: block staging] The coded modes: each codec block's param value, grad and moments staged
// as fp32 a group at a time, the same element math run on them, and everything stored back
// through its codec, the int8 codes one block behind ([note: group staging]).
template <DType P, DType G, MasterKind M, StateCodec C, bool kAmsgrad, bool kWriteGrad>
void adamw_block_range(const AdamWCall& call, int64_t tensor, const AdamWCoefficients c,
                       float multiplier, int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  const ChunkKeys keys = chunk_keys(call, tensor, begin);
  const StagedParam<P, G, M> param = staged_param<P, G, M>(call, tensor, keys);
  void* const m_state = lists[kAdamWExpAvg][tensor];
  void* const v_state = lists[kAdamWExpAvgSq][tensor];
  void* const v_max_state = lists[kAdamWMaxExpAvgSq][tensor];
  // The moments round with one dithered draw per element ([note: shared state draws],
  // [note: dithered draws]).
  const uint32_t moments_key = keys.dither_key(RoundingStream::kState0);
  const uint32_t rotation = keys.rotation();
  StagedState<C, true, DrawShare::kLow> exp_avg(
      m_state, static_cast<uint16_t*>(lists[kAdamWExpAvgScale][tensor]), moments_key, rotation);
  StagedState<C, false, DrawShare::kHigh> exp_avg_sq(
      v_state, static_cast<uint16_t*>(lists[kAdamWExpAvgSqScale][tensor]), moments_key, rotation);
  StagedState<C, false, DrawShare::kWhole> max_exp_avg_sq(
      v_max_state, static_cast<uint16_t*>(lists[kAdamWMaxExpAvgSqScale][tensor]),
      keys.dither_key(RoundingStream::kState1), rotation);
  alignas(64) float value_tile[kBlockGroup], grad_tile[kBlockGroup];
  alignas(64) uint32_t draw_tile[kBlockGroup];
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kAmsgrad) {
      param.template prefetch<C>(block, end, m_state, v_state, v_max_state);
    } else {
      param.template prefetch<C>(block, end, m_state, v_state);
    }
    auto m = exp_avg.begin_block(block, n);
    auto v = exp_avg_sq.begin_block(block, n);
    // An absent state's block stays empty: its pointers are not the state's (nor its scales).
    auto v_max = kAmsgrad ? max_exp_avg_sq.begin_block(block, n) : StateBlock<C, false, DrawShare::kWhole>{};
    for_each_stage_group<kBlockGroup>(block, block + n, [&](int64_t first, auto group) {
      const int64_t offset = first - block;
      const StagedGroup x = param.stage(first, group, value_tile, grad_tile);
      const AdamWTensorPointers tile{x.value,
                                     x.grad,
                                     nullptr,
                                     m.stage(offset, group),
                                     v.stage(offset, group),
                                     kAmsgrad ? v_max.stage(offset, group) : nullptr};
      adamw_elements<DType::kFloat32, DType::kFloat32, MasterKind::kNone, kAmsgrad, kWriteGrad>(
          tile, c, multiplier, 0, group);
      unstage_state_pair(m, v, offset, group, draw_tile);
      if (kAmsgrad) {
        v_max.unstage(offset, group);
        v_max.encode_pending(offset, group);
      }
      param.template unstage<kWriteGrad>(first, group, x, call.rounding.enabled);
    });
    exp_avg.end_block(m, block, n);
    exp_avg_sq.end_block(v, block, n);
    if (kAmsgrad) max_exp_avg_sq.end_block(v_max, block, n);
  });
  exp_avg.finish();
  exp_avg_sq.finish();
  if (kAmsgrad) max_exp_avg_sq.finish();
}

void adamw_chunk(const AdamWCall& call, const AdamWCoefficients& coefficients, int64_t tensor,
                 int64_t begin, int64_t end) {
  const float multiplier = grad_multiplier(call.inputs);
  dispatch_optimizer_chunk(
      call, {call.hyper.amsgrad, call.inputs.write_grad},
      [&](auto p, auto g, auto m, auto amsgrad, auto write_grad) {
        const auto& lists = call.lists.pointers;
        const AdamWTensorPointers pointers{
            lists[kAdamWParam][tensor], lists[kAdamWGrad][tensor], lists[kAdamWMaster][tensor],
            static_cast<float*>(lists[kAdamWExpAvg][tensor]), static_cast<float*>(lists[kAdamWExpAvgSq][tensor]),
            static_cast<float*>(lists[kAdamWMaxExpAvgSq][tensor])};
        adamw_range<p.value, g.value, m.value, amsgrad.value, write_grad.value>(pointers, coefficients,
                                                                                multiplier, begin, end);
      },
      [&](auto p, auto g, auto m, auto codec, auto amsgrad, auto write_grad) {
        adamw_block_range<p.value, g.value, m.value, codec.value, amsgrad.value, write_grad.value>(
            call, tensor, coefficients, multiplier, begin, end);
      });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(AdamWCall, adamw_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void adamw_cpu(const AdamWCall& call) { run_optimizer_step(call); }

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, AdamWCall, adamw_cpu);
#endif

}  // namespace fusedamp::cpu

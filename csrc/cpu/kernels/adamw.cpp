// CPU kernels of adamw_ (built once per ISA, see setup.py): the per-chunk loop over
// math/adamw.h, and the driver that runs it.
#include "ops/adamw.h"

#include "cpu/blocks.h"
#include "fusedamp/dispatch.h"

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
  // A block at a time behind the prefetches of the blocks ahead ([note: block prefetch]).
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kAmsgrad) {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.exp_avg, tensor.exp_avg_sq, tensor.max_exp_avg_sq);
    } else {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.exp_avg, tensor.exp_avg_sq);
    }
    if constexpr (P != staged<P> || G != staged<G>) {
      float param_tile[kStageLanes], grad_tile[kStageLanes];
      for_each_stage_group(block, block + n, [&](int64_t first, auto group) {
        AdamWTensorPointers tile = staged_tile<P, G, M>(tensor, first, group, param_tile, grad_tile);
        tile.exp_avg += first;
        tile.exp_avg_sq += first;
        if (kAmsgrad) tile.max_exp_avg_sq += first;
        adamw_elements<staged<P>, staged<G>, staged_master<P, M>, kAmsgrad, kWriteGrad>(
            tile, c, multiplier, 0, group);
        unstage_tile<P, G, M>(tensor, first, group, param_tile, grad_tile, kWriteGrad);
      });
    } else {
      adamw_elements<P, G, M, kAmsgrad, kWriteGrad>(tensor, c, multiplier, block, block + n);
    }
  });
}

// [note: block staging] The coded modes: each codec block's param value, grad and moments staged
// as fp32 a group at a time, the same element math run on them, and everything stored back
// through its codec, the int8 codes one block behind ([note: group staging]).
template <DType P, DType G, MasterKind M, StateCodec C, bool kAmsgrad, bool kWriteGrad>
void adamw_block_range(const AdamWCall& call, int64_t tensor, const AdamWCoefficients c,
                       float multiplier, int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  void* param = lists[kAdamWParam][tensor];
  void* grad = lists[kAdamWGrad][tensor];
  void* master = lists[kAdamWMaster][tensor];
  const StochasticRounding& rounding = call.rounding;
  const void* rounding_id = lists[kAdamWRoundingId][tensor];
  const float step = *static_cast<const float*>(lists[kAdamWStep][tensor]);
  auto key_of = [&](RoundingStream stream) {
    return chunk_rounding_key(rounding.seed, rounding_id, step, begin, stream);
  };
  const uint32_t key = rounding.enabled ? key_of(RoundingStream::kParam) : 0u;
  StagedState<C, true> exp_avg(lists[kAdamWExpAvg][tensor], static_cast<float*>(lists[kAdamWExpAvgScale][tensor]),
                               key_of(RoundingStream::kState0));
  StagedState<C, false> exp_avg_sq(lists[kAdamWExpAvgSq][tensor],
                                   static_cast<float*>(lists[kAdamWExpAvgSqScale][tensor]),
                                   key_of(RoundingStream::kState1));
  StagedState<C, false> max_exp_avg_sq(lists[kAdamWMaxExpAvgSq][tensor],
                                       static_cast<float*>(lists[kAdamWMaxExpAvgSqScale][tensor]),
                                       key_of(RoundingStream::kState2));
  alignas(64) float value_tile[kBlockGroup], grad_tile[kBlockGroup];
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kAmsgrad) {
      prefetch_ahead<P, G, M, C>(block, end, param, master, grad, lists[kAdamWExpAvg][tensor],
                                 lists[kAdamWExpAvgSq][tensor], lists[kAdamWMaxExpAvgSq][tensor]);
    } else {
      prefetch_ahead<P, G, M, C>(block, end, param, master, grad, lists[kAdamWExpAvg][tensor],
                                 lists[kAdamWExpAvgSq][tensor]);
    }
    auto m = exp_avg.begin_block(block, n);
    auto v = exp_avg_sq.begin_block(block, n);
    // An absent state's block stays empty: its pointers are not the state's (nor its scales).
    auto v_max = kAmsgrad ? max_exp_avg_sq.begin_block(block, n) : StateBlock<C, false>{};
    for_each_stage_group<kBlockGroup>(block, block + n, [&](int64_t first, auto group) {
      const int64_t offset = first - block;
      const AdamWTensorPointers tile{stage_value_block<P, M>(param, master, first, group, value_tile),
                                     stage_grad_block<G>(grad, first, group, grad_tile),
                                     nullptr,
                                     m.stage(offset, group),
                                     v.stage(offset, group),
                                     kAmsgrad ? v_max.stage(offset, group) : nullptr};
      adamw_elements<DType::kFloat32, DType::kFloat32, MasterKind::kNone, kAmsgrad, kWriteGrad>(
          tile, c, multiplier, 0, group);
      m.unstage(offset, group);
      v.unstage(offset, group);
      if (kAmsgrad) v_max.unstage(offset, group);
      m.encode_pending(offset, group);
      v.encode_pending(offset, group);
      if (kAmsgrad) v_max.encode_pending(offset, group);
      unstage_grad_block<G>(grad, first, group, static_cast<const float*>(tile.grad), kWriteGrad);
      unstage_value_block<P, M>(param, master, first, group, static_cast<const float*>(tile.param),
                                rounding.enabled, key);
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
  const auto& lists = call.lists.pointers;
  if (call.state_codec != StateCodec::kFloat32 || call.rounding.enabled) {
    const float multiplier = grad_multiplier(call.inputs);
    with_float_dtype(call.param_dtype, [&](auto p) {
      with_float_dtype(call.grad_dtype, [&](auto g) {
        with_master_kind<p.value>(call.master_kind, [&](auto m) {
          with_state_codec(call.state_codec, [&](auto codec) {
            with_bool(call.hyper.amsgrad, [&](auto amsgrad) {
              with_bool(call.inputs.write_grad, [&](auto write_grad) {
                adamw_block_range<p.value, g.value, m.value, codec.value, amsgrad.value,
                                  write_grad.value>(call, tensor, coefficients, multiplier, begin,
                                                    end);
              });
            });
          });
        });
      });
    });
    return;
  }
  const AdamWTensorPointers pointers{
      lists[kAdamWParam][tensor], lists[kAdamWGrad][tensor], lists[kAdamWMaster][tensor],
      static_cast<float*>(lists[kAdamWExpAvg][tensor]),
      static_cast<float*>(lists[kAdamWExpAvgSq][tensor]),
      static_cast<float*>(lists[kAdamWMaxExpAvgSq][tensor])};
  const float multiplier = grad_multiplier(call.inputs);
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<p.value>(call.master_kind, [&](auto m) {
        with_bool(call.hyper.amsgrad, [&](auto amsgrad) {
          with_bool(call.inputs.write_grad, [&](auto write_grad) {
            adamw_range<p.value, g.value, m.value, amsgrad.value, write_grad.value>(
                pointers, coefficients, multiplier, begin, end);
          });
        });
      });
    });
  });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(AdamWCall, adamw_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void adamw_cpu(const AdamWCall& call) {
  if (step_skipped(call.inputs)) return;
  const std::vector<void*>& steps = call.lists.pointers[kAdamWStep];
  const double lr = step_lr(call.inputs);
  const AdamWHyperparameters& h = call.hyper;
  std::vector<AdamWCoefficients> coefficients;
  coefficients.reserve(steps.size());
  for (void* step : steps) {
    coefficients.push_back(adamw_coefficients(lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                                              h.maximize, double(*static_cast<float*>(step)) + 1.0));
  }
  const AdamWCall::CpuChunk chunk = cpu_chunk<AdamWCall>();
  static_assert(kChunkSize % kCodecBlock == 0, "CPU chunks must hold whole codec blocks");
  for_each_chunk(call.lists.numels, [&](int64_t tensor, int64_t begin, int64_t end) {
    chunk(call, coefficients[tensor], tensor, begin, end);
  });
  increment_steps(steps);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, AdamWCall, adamw_cpu);
#endif

}  // namespace fusedamp::cpu

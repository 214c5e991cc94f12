// CPU kernels of sgd_ (built once per ISA, see setup.py): the per-chunk loop over math/sgd.h,
// and the driver that runs it.
#include "ops/sgd.h"

#include "cpu/blocks.h"
#include "fusedamp/dispatch.h"

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
  // A block at a time behind the prefetches of the blocks ahead ([note: block prefetch]).
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kHasMomentum) {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad,
                                                    tensor.momentum_buffer);
    } else {
      prefetch_ahead<P, G, M, StateCodec::kFloat32>(block, end, tensor.param, tensor.master, tensor.grad);
    }
    if constexpr (P != staged<P> || G != staged<G>) {
      float param_tile[kStageLanes], grad_tile[kStageLanes];
      for_each_stage_group(block, block + n, [&](int64_t first, auto group) {
        SgdTensorPointers tile = staged_tile<P, G, M>(tensor, first, group, param_tile, grad_tile);
        if (kHasMomentum) tile.momentum_buffer += first;
        sgd_elements<staged<P>, staged<G>, staged_master<P, M>, kHasMomentum, kWriteGrad>(
            tile, c, multiplier, 0, group);
        unstage_tile<P, G, M>(tensor, first, group, param_tile, grad_tile, kWriteGrad);
      });
    } else {
      sgd_elements<P, G, M, kHasMomentum, kWriteGrad>(tensor, c, multiplier, block, block + n);
    }
  });
}

// [note: block staging] The coded modes, as adamw_block_range: the momentum buffer through the
// call's state codec, the param through its master mode or stochastic rounding.
template <DType P, DType G, MasterKind M, StateCodec C, bool kHasMomentum, bool kWriteGrad>
void sgd_block_range(const SgdCall& call, int64_t tensor, const SgdCoefficients c, float multiplier,
                     int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  void* param = lists[kSgdParam][tensor];
  void* grad = lists[kSgdGrad][tensor];
  void* master = lists[kSgdMaster][tensor];
  void* buffer = lists[kSgdMomentumBuffer][tensor];
  const StochasticRounding& rounding = call.rounding;
  const void* rounding_id = lists[kSgdRoundingId][tensor];
  const float step = *static_cast<const float*>(lists[kSgdStep][tensor]);
  auto key_of = [&](RoundingStream stream) {
    return chunk_rounding_key(rounding.seed, rounding_id, step, begin, stream);
  };
  const uint32_t key = rounding.enabled ? key_of(RoundingStream::kParam) : 0u;
  StagedState<C, true> momentum(buffer, static_cast<float*>(lists[kSgdMomentumBufferScale][tensor]),
                                key_of(RoundingStream::kState0));
  alignas(64) float value_tile[kBlockGroup], grad_tile[kBlockGroup];
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    if (kHasMomentum) {
      prefetch_ahead<P, G, M, C>(block, end, param, master, grad, buffer);
    } else {
      prefetch_ahead<P, G, M, C>(block, end, param, master, grad);
    }
    // Without momentum the block stays empty: there is no buffer (nor scales) to read.
    auto b = kHasMomentum ? momentum.begin_block(block, n) : StateBlock<C, true>{};
    for_each_stage_group<kBlockGroup>(block, block + n, [&](int64_t first, auto group) {
      const int64_t offset = first - block;
      const SgdTensorPointers tile{stage_value_block<P, M>(param, master, first, group, value_tile),
                                   stage_grad_block<G>(grad, first, group, grad_tile), nullptr,
                                   kHasMomentum ? b.stage(offset, group) : nullptr};
      sgd_elements<DType::kFloat32, DType::kFloat32, MasterKind::kNone, kHasMomentum, kWriteGrad>(
          tile, c, multiplier, 0, group);
      if (kHasMomentum) {
        b.unstage(offset, group);
        b.encode_pending(offset, group);
      }
      unstage_grad_block<G>(grad, first, group, static_cast<const float*>(tile.grad), kWriteGrad);
      unstage_value_block<P, M>(param, master, first, group, static_cast<const float*>(tile.param),
                                rounding.enabled, key);
    });
    if (kHasMomentum) momentum.end_block(b, block, n);
  });
  if (kHasMomentum) momentum.finish();
}

void sgd_chunk(const SgdCall& call, const SgdCoefficients& coefficients, int64_t tensor,
               int64_t begin, int64_t end) {
  const auto& lists = call.lists.pointers;
  if (call.state_codec != StateCodec::kFloat32 || call.rounding.enabled) {
    const float multiplier = grad_multiplier(call.inputs);
    with_float_dtype(call.param_dtype, [&](auto p) {
      with_float_dtype(call.grad_dtype, [&](auto g) {
        with_master_kind<p.value>(call.master_kind, [&](auto m) {
          with_state_codec(call.state_codec, [&](auto codec) {
            with_bool(coefficients.momentum != 0.0f, [&](auto has_momentum) {
              with_bool(call.inputs.write_grad, [&](auto write_grad) {
                sgd_block_range<p.value, g.value, m.value, codec.value, has_momentum.value,
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
  const SgdTensorPointers pointers{lists[kSgdParam][tensor], lists[kSgdGrad][tensor],
                                   lists[kSgdMaster][tensor],
                                   static_cast<float*>(lists[kSgdMomentumBuffer][tensor])};
  const float multiplier = grad_multiplier(call.inputs);
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      with_master_kind<p.value>(call.master_kind, [&](auto m) {
        with_bool(coefficients.momentum != 0.0f, [&](auto has_momentum) {
          with_bool(call.inputs.write_grad, [&](auto write_grad) {
            sgd_range<p.value, g.value, m.value, has_momentum.value, write_grad.value>(
                pointers, coefficients, multiplier, begin, end);
          });
        });
      });
    });
  });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(SgdCall, sgd_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void sgd_cpu(const SgdCall& call) {
  if (step_skipped(call.inputs)) return;
  const std::vector<void*>& steps = call.lists.pointers[kSgdStep];
  const double lr = step_lr(call.inputs);
  const SgdHyperparameters& h = call.hyper;
  std::vector<SgdCoefficients> coefficients;
  coefficients.reserve(steps.size());
  for (void* step : steps) {
    const bool first_step = *static_cast<float*>(step) == 0.0f;
    coefficients.push_back(sgd_coefficients(lr, h.momentum, h.dampening, h.weight_decay,
                                            h.nesterov, h.maximize, first_step));
  }
  const SgdCall::CpuChunk chunk = cpu_chunk<SgdCall>();
  for_each_chunk(call.lists.numels, [&](int64_t tensor, int64_t begin, int64_t end) {
    chunk(call, coefficients[tensor], tensor, begin, end);
  });
  increment_steps(steps);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, SgdCall, sgd_cpu);
#endif

}  // namespace fusedamp::cpu

// CPU kernels of adamw_ (built once per ISA, see setup.py): the per-chunk loop over
// math/adamw.h, and the driver that runs it.
#include "ops/adamw.h"

#include "cpu/staging.h"
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
                 int64_t begin, int64_t end, bool stream_params) {
  if constexpr (P != staged<P> || G != staged<G>) {
    float param_tile[kStageLanes], grad_tile[kStageLanes];
    for_each_stage_group(begin, end, [&](int64_t first, auto n) {
      AdamWTensorPointers tile = staged_tile<P, G, M>(tensor, first, n, param_tile, grad_tile);
      tile.exp_avg += first;
      tile.exp_avg_sq += first;
      if (kAmsgrad) tile.max_exp_avg_sq += first;
      adamw_elements<staged<P>, staged<G>, staged_master<P, M>, kAmsgrad, kWriteGrad>(
          tile, c, multiplier, 0, n);
      unstage_tile<P, G, M>(tensor, first, n, param_tile, grad_tile, kWriteGrad, stream_params);
    });
    finish_param_stream<M>(stream_params);
  } else {
    adamw_elements<P, G, M, kAmsgrad, kWriteGrad>(tensor, c, multiplier, begin, end);
  }
}

void adamw_chunk(const AdamWCall& call, const AdamWCoefficients& coefficients, int64_t tensor,
                 int64_t begin, int64_t end, bool stream_params) {
  const auto& lists = call.lists.pointers;
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
                pointers, coefficients, multiplier, begin, end, stream_params);
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
  // Bytes a param moves: p, g, m, v and an fp32 master, about (see bench_optim's JOB_BYTES).
  const bool stream = stream_param_stores(call.lists.numels, 28);
  for_each_chunk(call.lists.numels, [&](int64_t tensor, int64_t begin, int64_t end) {
    chunk(call, coefficients[tensor], tensor, begin, end, stream);
  });
  increment_steps(steps);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, AdamWCall, adamw_cpu);
#endif

}  // namespace fusedamp::cpu

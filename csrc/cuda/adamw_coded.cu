// CUDA kernel of adamw_ in the coded modes ([note: state codecs]): bf16 or 8-bit moments, and
// stochastically rounded params, in the same fused pass as cuda/adamw.cu (its own file: the
// instantiations compile in parallel with the plain ones).
#include <c10/cuda/CUDAGuard.h>

#include "cuda/codec.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "ops/adamw.h"

namespace fusedamp::cuda {
namespace {

struct AdamWCodedArgs {
  StepInputs inputs;
  AdamWHyperparameters hyper;
  StochasticRounding rounding;
};

// kStochastic: half params without masters (M == kNone) take the fp32 update stochastically
// rounded, with the bits of math/stochastic.h; the math then runs on the param as fp32.
template <DType P, DType G, MasterKind M, StateCodec C, bool kStochastic>
__global__ void __launch_bounds__(kBlockThreads)
    adamw_coded_kernel(const __grid_constant__ ChunkMetadata<kAdamWLists> meta, const AdamWCodedArgs args) {
  constexpr int E = kOptimizerElements;
  using State = codec_storage_t<C>;
  if (step_skipped(args.inputs)) return;
  const ChunkLocation chunk = this_chunk(meta);
  __shared__ AdamWCoefficients shared_coefficients;
  const float step = *static_cast<const float*>(meta.pointers[kAdamWStep][chunk.slot]);
  if (threadIdx.x == 0) {
    const AdamWHyperparameters& h = args.hyper;
    shared_coefficients = adamw_coefficients(step_lr(args.inputs), h.beta1, h.beta2, h.eps,
                                             h.weight_decay, h.maximize, double(step) + 1.0);
  }
  __syncthreads();
  const AdamWCoefficients coefficients = shared_coefficients;
  const float multiplier = grad_multiplier(args.inputs);
  const bool amsgrad = args.hyper.amsgrad;
  const void* rounding_id = meta.pointers[kAdamWRoundingId][chunk.slot];
  auto key_of = [&](RoundingStream stream) {
    return chunk_rounding_key(args.rounding.seed, rounding_id, step, chunk.begin, stream);
  };
  const uint32_t key = kStochastic ? key_of(RoundingStream::kParam) : 0u;
  const uint32_t exp_avg_key = key_of(RoundingStream::kState0);
  const uint32_t exp_avg_sq_key = key_of(RoundingStream::kState1);
  const uint32_t max_exp_avg_sq_key = key_of(RoundingStream::kState2);

  auto* param = chunk_pointer<storage_t<P>>(meta, kAdamWParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kAdamWGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kAdamWMaster, chunk);
  auto* exp_avg = chunk_pointer<State>(meta, kAdamWExpAvg, chunk);
  auto* exp_avg_sq = chunk_pointer<State>(meta, kAdamWExpAvgSq, chunk);
  auto* max_exp_avg_sq = chunk_pointer<State>(meta, kAdamWMaxExpAvgSq, chunk);
  const int64_t first_scale = chunk.begin / kCodecBlock;
  auto scales_of = [&](int list) {
    float* base = static_cast<float*>(meta.pointers[list][chunk.slot]);
    return base == nullptr ? nullptr : base + first_scale;
  };
  float* exp_avg_scales = scales_of(kAdamWExpAvgScale);
  float* exp_avg_sq_scales = scales_of(kAdamWExpAvgSqScale);
  float* max_exp_avg_sq_scales = scales_of(kAdamWMaxExpAvgSqScale);
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq);
  // [note: coded iterations]: every thread runs every iteration.
  for (int base = 0; base < count; base += CodedIterations<E>::kElements) {
    const int first = base + int(threadIdx.x) * E;
    const bool vector = aligned && first + E <= count;
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    StateGroup<C, true, E> m;
    StateGroup<C, false, E> v, v_max;
    grad_group.load(grad, first, count, vector);
    param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    m.load(exp_avg, exp_avg_scales, first, count, vector);
    v.load(exp_avg_sq, exp_avg_sq_scales, first, count, vector);
    if (amsgrad) v_max.load(max_exp_avg_sq, max_exp_avg_sq_scales, first, count, vector);

    float value[E];
    if constexpr (kStochastic) {
#pragma unroll
      for (int j = 0; j < E; ++j) value[j] = load_float<P>(param_group.values, j);
    }
    const AdamWTensorPointers registers{kStochastic ? static_cast<void*>(value) : param_group.values,
                                        grad_group.values, master_group.values, m.values, v.values,
                                        v_max.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if constexpr (kStochastic) {
        adamw_element<DType::kFloat32, G, MasterKind::kNone>(registers, j, coefficients, multiplier,
                                                             args.inputs.write_grad, amsgrad);
        param_group.values[j] = float_to_half_stochastic<P>(
            value[j], rounding_bits(key, chunk.begin + first + j));
      } else {
        adamw_element<P, G, M>(registers, j, coefficients, multiplier, args.inputs.write_grad, amsgrad);
      }
    }

    // Read again, not kept from the prologue: held live across the loop it spilled (int8 moments).
    const int64_t element = this_chunk(meta).begin + first;
    m.store(exp_avg, exp_avg_scales, first, count, vector, exp_avg_key, element);
    v.store(exp_avg_sq, exp_avg_sq_scales, first, count, vector, exp_avg_sq_key, element);
    if (amsgrad) v_max.store(max_exp_avg_sq, max_exp_avg_sq_scales, first, count, vector, max_exp_avg_sq_key, element);
    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    if (args.inputs.write_grad) grad_group.store(grad, first, count, vector);
  }
}

}  // namespace

void adamw_coded_cuda(const AdamWCall& call) {
  static_assert(kChunkSize % (kBlockThreads * kOptimizerElements) == 0, "chunks of whole iterations");
  const AdamWCodedArgs args{call.inputs, call.hyper, call.rounding};
  with_coded_kernel(call, [&](auto p, auto g, auto m, auto c, auto stochastic) {
    const auto kernel = adamw_coded_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value,
                                         decltype(c)::value, decltype(stochastic)::value>;
    launch_chunks<kAdamWLists>(kernel, call.lists.pointers, call.lists.numels, args);
  });
}

}  // namespace fusedamp::cuda

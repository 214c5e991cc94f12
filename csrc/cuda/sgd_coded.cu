// CUDA kernel of sgd_ in the coded modes ([note: state codecs]): bf16 or 8-bit momentum buffers,
// and stochastically rounded params, in the same fused pass as cuda/sgd.cu.
#include <c10/cuda/CUDAGuard.h>

#include "cuda/codec.cuh"
#include "cuda/multi_tensor_apply.cuh"
#include "cuda/optimizer.cuh"
#include "fusedamp/dispatch.h"
#include "ops/sgd.h"

namespace fusedamp::cuda {
namespace {

struct SgdCodedArgs {
  StepInputs inputs;
  SgdHyperparameters hyper;
  StochasticRounding rounding;
};

// kStochastic: as adamw_coded_kernel.
template <DType P, DType G, MasterKind M, StateCodec C, bool kStochastic>
__global__ void __launch_bounds__(kBlockThreads)
    sgd_coded_kernel(const __grid_constant__ ChunkMetadata<kSgdLists> meta, const SgdCodedArgs args) {
  constexpr int E = kOptimizerElements;
  if (step_skipped(args.inputs)) return;
  const ChunkLocation chunk = this_chunk(meta);
  const float step = *static_cast<const float*>(meta.pointers[kSgdStep][chunk.slot]);
  const SgdHyperparameters& h = args.hyper;
  const SgdCoefficients coefficients = sgd_coefficients(
      step_lr(args.inputs), h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize,
      step == 0.0f);
  const float multiplier = grad_multiplier(args.inputs);
  const bool has_buffer = coefficients.momentum != 0.0f;
  const void* rounding_id = meta.pointers[kSgdRoundingId][chunk.slot];
  const uint32_t key =
      kStochastic ? chunk_rounding_key(args.rounding.seed, rounding_id, step, chunk.begin, RoundingStream::kParam) : 0u;
  const uint32_t buffer_key = chunk_rounding_key(args.rounding.seed, rounding_id, step, chunk.begin,
                                                 RoundingStream::kState0);

  auto* param = chunk_pointer<storage_t<P>>(meta, kSgdParam, chunk);
  auto* grad = chunk_pointer<storage_t<G>>(meta, kSgdGrad, chunk);
  auto* master = chunk_pointer<master_storage_t<M>>(meta, kSgdMaster, chunk);
  auto* buffer = chunk_pointer<codec_storage_t<C>>(meta, kSgdMomentumBuffer, chunk);
  float* scales = static_cast<float*>(meta.pointers[kSgdMomentumBufferScale][chunk.slot]);
  if (scales != nullptr) scales += chunk.begin / kCodecBlock;
  const int count = int(chunk.count);
  const bool aligned = all_aligned<E>(param, grad, master, buffer);
  // [note: coded iterations]: every thread runs every iteration.
  for (int base = 0; base < count; base += CodedIterations<E>::kElements) {
    const int first = base + int(threadIdx.x) * E;
    const bool vector = aligned && first + E <= count;
    ElementGroup<storage_t<P>, E> param_group;
    ElementGroup<storage_t<G>, E> grad_group;
    ElementGroup<master_storage_t<M>, E> master_group;
    StateGroup<C, true, E> buffer_group;
    grad_group.load(grad, first, count, vector);
    param_group.load(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.load(master, first, count, vector);
    if (has_buffer) buffer_group.load(buffer, scales, first, count, vector);

    float value[E];
    if constexpr (kStochastic) {
#pragma unroll
      for (int j = 0; j < E; ++j) value[j] = load_float<P>(param_group.values, j);
    }
    const SgdTensorPointers registers{kStochastic ? static_cast<void*>(value) : param_group.values,
                                      grad_group.values, master_group.values, buffer_group.values};
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if constexpr (kStochastic) {
        sgd_element<DType::kFloat32, G, MasterKind::kNone>(registers, j, coefficients, multiplier,
                                                           args.inputs.write_grad, has_buffer);
        param_group.values[j] = float_to_half_stochastic<P>(
            value[j], rounding_bits(key, chunk.begin + first + j));
      } else {
        sgd_element<P, G, M>(registers, j, coefficients, multiplier, args.inputs.write_grad, has_buffer);
      }
    }

    if (has_buffer) buffer_group.store(buffer, scales, first, count, vector, buffer_key, chunk.begin + first);
    param_group.store(param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master_group.store(master, first, count, vector);
    if (args.inputs.write_grad) grad_group.store(grad, first, count, vector);
  }
}

}  // namespace

void sgd_coded_cuda(const SgdCall& call) {
  const SgdCodedArgs args{call.inputs, call.hyper, call.rounding};
  with_coded_kernel(call, [&](auto p, auto g, auto m, auto c, auto stochastic) {
    const auto kernel = sgd_coded_kernel<decltype(p)::value, decltype(g)::value, decltype(m)::value,
                                         decltype(c)::value, decltype(stochastic)::value>;
    launch_chunks<kSgdLists>(kernel, call.lists.pointers, call.lists.numels, args);
  });
}

}  // namespace fusedamp::cuda

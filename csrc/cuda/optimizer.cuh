// What the CUDA optimizer steps share, in chunks (one block of kBlockThreads threads, E elements a
// thread at a time): the host side of a step (the device guard, the check of a host lr under graph
// capture, the plain or coded kernels, the step counts), the start of a block's chunk ([note:
// optimizer chunk]) and the param side of a thread's elements. The AdamW and SGD kernels
// (cuda/adamw.cu, adamw_coded.cu, sgd.cu, sgd_coded.cu) give their states and element math.
#pragma once

#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "cuda/multi_tensor_apply.cuh"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/master.h"
#include "fusedamp/math/stochastic.h"
#include "fusedamp/step_inputs.h"
#include "ops/optimizer.h"

namespace fusedamp {
struct AdamWCall;
struct SgdCall;
}  // namespace fusedamp

namespace fusedamp::cuda {

// The update kernels of the coded modes ([note: state codecs]): bf16 / 8-bit states or
// stochastically rounded params (cuda/adamw_coded.cu, cuda/sgd_coded.cu); the step counts are
// left to the caller.
void adamw_coded_cuda(const AdamWCall& call);
void sgd_coded_cuda(const SgdCall& call);

// Elements per thread per iteration of the optimizer kernels: with four to six lists per element
// that is already 50-100 bytes in flight per thread (one 128-bit access per fp32 list), and the
// kernels stay within ~64 registers, four 256-thread blocks per SM.
constexpr int kOptimizerElements = 4;

// A step whose lr was read on the host from a CPU tensor cannot be captured into a CUDA graph:
// every replay would reuse the captured value. Refuses that with a clear error.
void check_host_lr_not_captured(const StepInputs& inputs);

// steps[i] += 1 for every param unless found_inf (a device pointer, or null) is set. Launched
// after the update kernels, which therefore read the count before the step (stream order).
void increment_steps(const std::vector<void*>& steps, const float* found_inf);

// The host side of an optimizer's CUDA step: on the call's device, a host lr refused under graph
// capture, then the update: coded(call) in the coded modes (runs_coded), else plain(p, g, m), which
// launches the plain kernel of the tags' types (param, grad, master kind); then the step counts
// (Call::kCountsSteps).
template <typename Call, typename Plain>
void run_optimizer_step(const Call& call, void (*coded)(const Call&), Plain&& plain) {
  const c10::cuda::CUDAGuard guard(call.device);
  check_host_lr_not_captured(call.inputs);
  if (runs_coded(call)) {
    coded(call);
  } else {
    with_float_dtype(call.param_dtype, [&](auto p) {
      constexpr DType P = decltype(p)::value;
      with_float_dtype(call.grad_dtype, [&](auto g) {
        constexpr DType G = decltype(g)::value;
        if constexpr (!kSteppedGradType<P, G>) {
          fail_no_kernel("grad element type", int32_t(G), int32_t(P));
        } else {
          with_master_kind<P>(call.master_kind, [&](auto m) { plain(p, g, m); });
        }
      });
    });
  }
  if constexpr (Call::kCountsSteps) increment_steps(call.lists.pointers[Call::kStepList], call.inputs.found_inf);
}

// [note: optimizer chunk] What a block of an optimizer kernel knows of its chunk before its element
// loop, the same for every optimizer: nothing but `skipped` when the step is skipped (found_inf
// set, [note: found_inf]: the kernel returns before it reads anything); else the chunk, the
// tensor's step count before this step, its coefficients for this step (step_coefficients, made
// once per block: AdamW's take two pows in double), the grad multiplier, and what the chunk's
// rounding keys are made of.
template <typename Coefficients>
struct StepChunk {
  bool skipped;
  ChunkLocation chunk;
  float step;
  Coefficients coefficients;
  float multiplier;         // grad_multiplier: inv_grad_scale * clip_coef
  const void* rounding_id;  // the param's ([note: rounding ids]); null in the plain modes

  // The chunk's rounding keys ([note: unbiased state rounding]).
  __device__ __forceinline__ ChunkKeys keys(uint64_t seed) const {
    return {seed, rounding_id, step, chunk.begin};
  }
};

// The StepChunk of this block. Every thread of the block calls it (a barrier shares the
// coefficients).
template <typename Call, typename Meta>
__device__ __forceinline__ auto begin_step_chunk(const Meta& meta, const StepArgs<Call>& args) {
  using Coefficients = decltype(step_coefficients(args.hyper, 0.0, 0.0f));
  StepChunk<Coefficients> s{};
  s.skipped = step_skipped(args.inputs);
  if (s.skipped) return s;
  s.chunk = this_chunk(meta);
  s.step = *slot_pointer<const float>(meta, Call::kStepList, s.chunk.slot);
  __shared__ Coefficients shared_coefficients;
  if (threadIdx.x == 0) shared_coefficients = step_coefficients(args.hyper, step_lr(args.inputs), s.step);
  __syncthreads();
  s.coefficients = shared_coefficients;
  s.multiplier = grad_multiplier(args.inputs);
  s.rounding_id = slot_pointer<const void>(meta, Call::kRoundingIdList, s.chunk.slot);
  return s;
}

// The param side of a chunk: its param, grad and master (null without one) at its first element.
template <DType P, DType G, MasterKind M>
struct ParamChunk {
  storage_t<P>* param;
  storage_t<G>* grad;
  master_storage_t<M>* master;
};

template <typename Call, DType P, DType G, MasterKind M, typename Meta>
__device__ __forceinline__ ParamChunk<P, G, M> param_chunk(const Meta& meta,
                                                           const ChunkLocation& chunk) {
  return {chunk_pointer<storage_t<P>>(meta, Call::kParamList, chunk),
          chunk_pointer<storage_t<G>>(meta, Call::kGradList, chunk),
          chunk_pointer<master_storage_t<M>>(meta, Call::kMasterList, chunk)};
}

// A thread's E elements of the param side in registers: param, grad and master, loaded before
// the op's math and stored after it.
template <DType P, DType G, MasterKind M, int E>
struct ParamGroups {
  ElementGroup<storage_t<P>, E> param;
  ElementGroup<storage_t<G>, E> grad;
  ElementGroup<master_storage_t<M>, E> master;

  __device__ __forceinline__ void load(const ParamChunk<P, G, M>& chunk, int first, int count, bool vector) {
    grad.load(chunk.grad, first, count, vector);
    // The param even with an fp32 master: load_master compares them ([note: edited params]).
    param.load(chunk.param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master.load(chunk.master, first, count, vector);
  }

  // element(p, m, param, j) for each of the E elements: the op's element math on element j with
  // `param` as its param pointer, and p, m the param type and master kind that pointer has. That
  // is the group itself; or (kStochastic: half params without a master) its values as fp32,
  // rounded back stochastically with the bits of elements [first_element, first_element + E)
  // under `key` (math/stochastic.h).
  template <bool kStochastic = false, typename Element>
  __device__ __forceinline__ void update(Element&& element, uint32_t key = 0u, int64_t first_element = 0) {
    if constexpr (kStochastic) {
      float value[E];
#pragma unroll
      for (int j = 0; j < E; ++j) value[j] = load_float<P>(param.values, j);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        element(DTypeTag<DType::kFloat32>{}, MasterTag<MasterKind::kNone>{}, static_cast<void*>(value), j);
        param.values[j] = float_to_half_stochastic<P>(value[j], rounding_bits(key, first_element + j));
      }
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) element(DTypeTag<P>{}, MasterTag<M>{}, static_cast<void*>(param.values), j);
    }
  }

  __device__ __forceinline__ void store(const ParamChunk<P, G, M>& chunk, int first, int count, bool vector,
                                        bool write_grad) const {
    param.store(chunk.param, first, count, vector);
    if constexpr (M != MasterKind::kNone) master.store(chunk.master, first, count, vector);
    if (write_grad) grad.store(chunk.grad, first, count, vector);
  }
};

}  // namespace fusedamp::cuda

// What every CPU optimizer step shares, in chunks (one task of for_each_chunk: whole codec blocks
// of one tensor): the driver (a skipped step, the coefficients per tensor, the chunks on torch's
// threads, the step counts), the dispatch of a chunk to the kernel of the call's types, codec and
// flags, and the loops of the plain and coded modes around an op's element math. An optimizer's
// kernel file (csrc/cpu/kernels/adamw.cpp, sgd.cpp) gives its element loop and its states.
// Included by csrc/cpu/kernels/*.cpp only, after their ISA preamble.
#pragma once

#include "cpu/blocks.h"
#include "cpu/staging.h"
#include "fusedamp/dispatch.h"
#include "ops/optimizer.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// Runs the chunk kernel of an optimizer call's types: coded(p, g, m, codec, flags...) in its coded
// modes (runs_coded, [note: block staging]), else plain(p, g, m, flags...). Each argument is a
// tag whose ::value is a template argument of the kernel: the param and grad element types, the
// master kind, the state codec, and one bool per flag (the op's, e.g. amsgrad and write_grad).
// fp32 states take the coded loop only for stochastically rounded params (half, no master: the
// ops' checks admit nothing else), so no other fp32 coded kernel is built; nor any kernel for a
// (param, grad) pair that check_optimizer_lists refuses (kSteppedGradType).
template <typename Call, size_t N, typename Plain, typename Coded>
[[gnu::always_inline]] inline void dispatch_optimizer_chunk(const Call& call, const bool (&flags)[N],
                                                            Plain&& plain, Coded&& coded) {
  const bool coded_modes = runs_coded(call);
  with_float_dtype(call.param_dtype, [&](auto p) {
    with_float_dtype(call.grad_dtype, [&](auto g) {
      if constexpr (!kSteppedGradType<p.value, g.value>) {
        fail_no_kernel("grad element type", int32_t(g.value), int32_t(p.value));
      } else {
        with_master_kind<p.value>(call.master_kind, [&](auto m) {
          if (coded_modes) {
            with_state_codec(call.state_codec, [&](auto codec) {
              constexpr bool kStochasticOnly = codec.value == StateCodec::kFloat32;
              if constexpr (!kStochasticOnly || (p.value != DType::kFloat32 && m.value == MasterKind::kNone)) {
                with_bools(flags, [&](auto... flag) { coded(p, g, m, codec, flag...); });
              } else {
                fail_no_kernel("fp32 states of params rounded to nearest in the coded loop", int32_t(codec.value));
              }
            });
          } else {
            with_bools(flags, [&](auto... flag) { plain(p, g, m, flag...); });
          }
        });
      }
    });
  });
}

// The plain modes (fp32 states) over elements [begin, end) of one tensor: a codec block at a time
// behind the prefetches of the blocks ahead ([note: block prefetch]: prefetch(block) asks for the
// op's streams), a half param or grad staged through fp32 a group of kStageLanes at a time
// ([note: half staging]). elements(p, g, m, at, first, n) runs the op's element loop over
// elements [0, n) of `at`, the tensor's pointers with param, grad and master moved to element
// `first` (onto fp32 tiles when staged: p, g and m are then the staged types); the op moves its
// states there too.
template <DType P, DType G, MasterKind M, bool kWriteGrad, typename Pointers, typename Prefetch,
          typename Elements>
[[gnu::always_inline]] inline void plain_step_range(const Pointers& tensor, int64_t begin, int64_t end,
                                                    Prefetch&& prefetch, Elements&& elements) {
  for_each_codec_block(begin, end, [&](int64_t block, int64_t n) {
    prefetch(block);
    if constexpr (P != staged<P> || G != staged<G>) {
      float param_tile[kStageLanes], grad_tile[kStageLanes];
      for_each_stage_group(block, block + n, [&](int64_t first, auto group) {
        elements(DTypeTag<staged<P>>{}, DTypeTag<staged<G>>{}, MasterTag<staged_master<P, M>>{},
                 staged_tile<P, G, M>(tensor, first, group, param_tile, grad_tile), first, group);
        unstage_tile<P, G, M>(tensor, first, group, param_tile, grad_tile, kWriteGrad);
      });
    } else {
      // Nothing to stage: staged_tile only moves the pointers.
      elements(DTypeTag<P>{}, DTypeTag<G>{}, MasterTag<M>{},
               staged_tile<P, G, M>(tensor, block, n, nullptr, nullptr), block, n);
    }
  });
}

// The rounding keys of the chunk from element `begin` of tensor `tensor` of an optimizer call.
template <typename Call>
[[gnu::always_inline]] inline ChunkKeys chunk_keys(const Call& call, int64_t tensor, int64_t begin) {
  const auto& lists = call.lists.pointers;
  return {call.rounding.seed, lists[Call::kRoundingIdList][tensor],
          *static_cast<const float*>(lists[Call::kStepList][tensor]), begin};
}

// A group of a coded step's param side as fp32: the values the math updates, and the grads.
struct StagedGroup {
  float* value;
  float* grad;
};

// The param side of one tensor in a coded step ([note: block staging]): its values as fp32 (the
// param, its fp32 master, or a half param joined with its remainder) and its grads, a group at a
// time, written back after the op's math (a half param rounded from its master, split with its
// remainder, or rounded to nearest or stochastically). A value, not a class with tiles, so that
// its pointers stay in registers.
template <DType P, DType G, MasterKind M>
struct StagedParam {
  void* param;
  void* grad;
  void* master;
  uint32_t key;  // of the param's stochastic rounding (the call's rounding.enabled)

  // The group of n values from element `first`, in these tiles where they are staged.
  [[gnu::always_inline]] StagedGroup stage(int64_t first, int64_t n, float* value_tile, float* grad_tile) const {
    return {stage_value_block<P, M>(param, master, first, n, value_tile),
            stage_grad_block<G>(grad, first, n, grad_tile)};
  }

  // Writes back the group that stage() gave, after the math updated it; `stochastic`: the call's
  // rounding.enabled, read from the call by the caller. There the compiler knows it along with
  // the dispatch that chose the kernel; held here as a copy, g++ 12 kept both roundings in the
  // AVX2 group loops (and warned about them with -Waggressive-loop-optimizations false positives).
  template <bool kWriteGrad>
  [[gnu::always_inline]] void unstage(int64_t first, int64_t n, StagedGroup group, bool stochastic) const {
    unstage_grad_block<G>(grad, first, n, group.grad, kWriteGrad);
    unstage_value_block<P, M>(param, master, first, n, group.value, stochastic, key);
  }

  // prefetch_ahead of the param side and the op's `states` (codec C).
  template <StateCodec C, typename... States>
  [[gnu::always_inline]] void prefetch(int64_t first, int64_t end, States... states) const {
    prefetch_ahead<P, G, M, C>(first, end, param, master, grad, states...);
  }
};

// The param side of tensor `tensor` of an optimizer call, in the chunk of `keys`.
template <DType P, DType G, MasterKind M, typename Call>
[[gnu::always_inline]] inline StagedParam<P, G, M> staged_param(const Call& call, int64_t tensor,
                                                                const ChunkKeys& keys) {
  const auto& lists = call.lists.pointers;
  return {lists[Call::kParamList][tensor], lists[Call::kGradList][tensor], lists[Call::kMasterList][tensor],
          call.rounding.enabled ? keys.key(RoundingStream::kParam) : 0u};
}

}  // namespace FUSEDAMP_ISA

#ifdef FUSEDAMP_CPU_DRIVER
// The driver of an optimizer op (the baseline build only, as every driver): nothing when the step
// is skipped ([note: found_inf]); else each tensor's coefficients for this step (step_coefficients
// of the op's hyperparameters, the lr and the tensor's step count before the step), then the chunk
// kernel of the active ISA build over every chunk of every tensor on torch's threads, then the
// step counts + 1.
template <typename Call>
void run_optimizer_step(const Call& call) {
  if (step_skipped(call.inputs)) return;
  const std::vector<void*>& steps = call.lists.pointers[Call::kStepList];
  const double lr = step_lr(call.inputs);
  std::vector<decltype(step_coefficients(call.hyper, lr, 0.0f))> coefficients;
  coefficients.reserve(steps.size());
  for (void* step : steps) {
    coefficients.push_back(step_coefficients(call.hyper, lr, *static_cast<const float*>(step)));
  }
  const typename Call::CpuChunk chunk = cpu_chunk<Call>();
  static_assert(kChunkSize % kCodecBlock == 0, "CPU chunks must hold whole codec blocks");
  for_each_chunk(call.lists.numels, [&](int64_t tensor, int64_t begin, int64_t end) {
    chunk(call, coefficients[tensor], tensor, begin, end);
  });
  if constexpr (Call::kCountsSteps) increment_steps(steps);
}
#endif

}  // namespace fusedamp::cpu

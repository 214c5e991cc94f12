// What the call struct of every optimizer op holds (ops/adamw.h, ops/sgd.h), for the code that
// both backends share around the ops' element math (cpu/optimizer.h, cuda/optimizer.cuh):
//   kParamList, kGradList, kMasterList, kStepList, kRoundingIdList  its lists of those
//   kCountsSteps                                                   whether its step advances the counts
//   param_dtype, grad_dtype, master_kind                           the element types, master kind
//   hyper, inputs (StepInputs)                                     hyperparameters, AMP scalars
//   state_codec, rounding (StochasticRounding)                     its states' codec, its rounding
// and, beside it, step_coefficients(hyper, lr, step): a tensor's coefficients for this step from
// its step count before it (host and device).
#pragma once

#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"
#include "fusedamp/multi_tensor_plan.h"
#include "fusedamp/step_inputs.h"

FUSEDAMP_NAMESPACE_BEGIN

// Whether an optimizer call runs its coded modes ([note: block staging]): states in bf16 or
// 8-bit codes, or params rounded stochastically. Else its plain modes: fp32 states, params
// rounded to nearest.
template <typename Call>
inline bool runs_coded(const Call& call) {
  return call.state_codec != StateCodec::kFloat32 || call.rounding.enabled;
}

// What every CUDA optimizer kernel takes besides its chunk metadata (here, not in the CUDA code:
// its size decides how many tensors one launch holds, [note: kernel parameter budget]).
template <typename Call>
struct StepArgs {
  StepInputs inputs;
  decltype(Call::hyper) hyper;
  StochasticRounding rounding;  // read by the coded kernels only
};

template <typename Call>
StepArgs<Call> step_args(const Call& call) {
  return {call.inputs, call.hyper, call.rounding};
}

FUSEDAMP_NAMESPACE_END

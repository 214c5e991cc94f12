// The call struct of adamw_: what its CPU and CUDA kernels receive, checked once by ops/adamw.cpp.
#pragma once

#include <c10/core/Device.h>

#include "common/tensor_lists.h"
#include "fusedamp/math/adamw.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/stochastic.h"
#include "fusedamp/step_inputs.h"
#include "ops/optimizer.h"

namespace fusedamp {

enum AdamWList { kAdamWParam, kAdamWGrad, kAdamWMaster, kAdamWExpAvg, kAdamWExpAvgSq,
                 kAdamWMaxExpAvgSq, kAdamWStep, kAdamWExpAvgScale, kAdamWExpAvgSqScale,
                 kAdamWMaxExpAvgSqScale, kAdamWRoundingId, kAdamWLists };

struct AdamWHyperparameters {
  double beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

struct AdamWCall {
  static constexpr const char* kOp = "adamw_";
  // The lists every optimizer has (ops/optimizer.h).
  static constexpr int kParamList = kAdamWParam, kGradList = kAdamWGrad, kMasterList = kAdamWMaster;
  static constexpr int kStepList = kAdamWStep, kRoundingIdList = kAdamWRoundingId;
  static constexpr bool kCountsSteps = true;
  // The lists a CUDA kernel reads ([note: kernel parameter budget]): with a master or without, its
  // moments in `codec`, in a coded mode (whose roundings are keyed by the rounding ids) or not.
  // max_exp_avg_sqs with amsgrad only, a run-time flag: always carried, so the kernels do not double.
  static constexpr uint32_t kernel_lists(bool master, StateCodec codec, bool coded) {
    return list_bit(kAdamWParam) | list_bit(kAdamWGrad) | list_bit(kAdamWExpAvg) | list_bit(kAdamWExpAvgSq) |
           list_bit(kAdamWMaxExpAvgSq) | list_bit(kAdamWStep) | (master ? list_bit(kAdamWMaster) : 0u) |
           (codec == StateCodec::kInt8
                ? list_bit(kAdamWExpAvgScale) | list_bit(kAdamWExpAvgSqScale) | list_bit(kAdamWMaxExpAvgSqScale)
                : 0u) |
           (coded ? list_bit(kAdamWRoundingId) : 0u);
  }
  // Steps elements [begin, end) of tensor `tensor` with its coefficients (made by the driver).
  using CpuChunk = void (*)(const AdamWCall&, const AdamWCoefficients&, int64_t tensor,
                            int64_t begin, int64_t end);
  c10::Device device;
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  // max_exp_avg_sqs null unless amsgrad, masters null without; the scales null unless the moments
  // are 8-bit codes; kAdamWRoundingId holds values, not pointers ([note: rounding ids]).
  TensorLists<kAdamWLists> lists;
  AdamWHyperparameters hyper;
  StepInputs inputs;
  StateCodec state_codec = StateCodec::kFloat32;  // of every moment list ([note: state codecs])
  StochasticRounding rounding;
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// The coefficients of a tensor whose step count before this step is `step`.
FUSEDAMP_HOST_DEVICE AdamWCoefficients step_coefficients(const AdamWHyperparameters& h, double lr, float step) {
  return adamw_coefficients(lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.maximize, double(step) + 1.0);
}

FUSEDAMP_NAMESPACE_END

// The call struct of sgd_: what its CPU and CUDA kernels receive, checked once by ops/sgd.cpp.
#pragma once

#include <c10/core/Device.h>

#include "common/tensor_lists.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/sgd.h"
#include "fusedamp/math/stochastic.h"
#include "fusedamp/step_inputs.h"
#include "ops/optimizer.h"

namespace fusedamp {

enum SgdList { kSgdParam, kSgdGrad, kSgdMaster, kSgdMomentumBuffer, kSgdStep,
               kSgdMomentumBufferScale, kSgdRoundingId, kSgdLists };

struct SgdHyperparameters {
  double momentum, dampening, weight_decay;
  bool nesterov, maximize;
};

struct SgdCall {
  static constexpr const char* kOp = "sgd_";
  // The lists every optimizer has (ops/optimizer.h).
  static constexpr int kParamList = kSgdParam, kGradList = kSgdGrad, kMasterList = kSgdMaster;
  static constexpr int kStepList = kSgdStep, kRoundingIdList = kSgdRoundingId;
  static constexpr bool kCountsSteps = true;
  // The lists a CUDA kernel reads ([note: kernel parameter budget]), as AdamWCall::kernel_lists.
  static constexpr uint32_t kernel_lists(bool master, StateCodec codec, bool coded) {
    return list_bit(kSgdParam) | list_bit(kSgdGrad) | list_bit(kSgdMomentumBuffer) | list_bit(kSgdStep) |
           (master ? list_bit(kSgdMaster) : 0u) | (codec == StateCodec::kInt8 ? list_bit(kSgdMomentumBufferScale) : 0u) |
           (coded ? list_bit(kSgdRoundingId) : 0u);
  }
  // Steps elements [begin, end) of tensor `tensor` with its coefficients (made by the driver).
  using CpuChunk = void (*)(const SgdCall&, const SgdCoefficients&, int64_t tensor, int64_t begin,
                            int64_t end);
  c10::Device device;
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  // momentum_buffers null when momentum is 0, masters null without, their scales null unless
  // 8-bit codes; kSgdRoundingId holds values, not pointers ([note: rounding ids]).
  TensorLists<kSgdLists> lists;
  SgdHyperparameters hyper;
  StepInputs inputs;
  StateCodec state_codec = StateCodec::kFloat32;  // of the momentum buffers ([note: state codecs])
  StochasticRounding rounding;
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

// The coefficients of a tensor whose step count before this step is `step` (0: its first step).
FUSEDAMP_HOST_DEVICE SgdCoefficients step_coefficients(const SgdHyperparameters& h, double lr, float step) {
  return sgd_coefficients(lr, h.momentum, h.dampening, h.weight_decay, h.nesterov, h.maximize, step == 0.0f);
}

FUSEDAMP_NAMESPACE_END

// The call struct of muon_momentum_: what its CPU and CUDA kernels receive, checked once by
// ops/muon.cpp. An optimizer call whose "params" are the updates it writes (no masters, never
// rounded stochastically) and whose step counts it reads but does not advance: the Muon step's
// param update (sgd_ on the orthogonalized updates) advances them.
#pragma once

#include <c10/core/Device.h>

#include "common/tensor_lists.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/muon.h"
#include "fusedamp/math/stochastic.h"
#include "fusedamp/step_inputs.h"
#include "ops/optimizer.h"

namespace fusedamp {

enum MuonList { kMuonUpdate, kMuonGrad, kMuonMaster, kMuonMomentumBuffer, kMuonStep,
                kMuonMomentumBufferScale, kMuonRoundingId, kMuonLists };

struct MuonHyperparameters {
  double momentum;
  bool nesterov;
};

struct MuonCall {
  static constexpr const char* kOp = "muon_momentum_";
  // The lists every optimizer has (ops/optimizer.h); the masters list is always empty.
  static constexpr int kParamList = kMuonUpdate, kGradList = kMuonGrad, kMasterList = kMuonMaster;
  static constexpr int kStepList = kMuonStep, kRoundingIdList = kMuonRoundingId;
  static constexpr bool kCountsSteps = false;
  // The lists a CUDA kernel reads ([note: kernel parameter budget]), as AdamWCall::kernel_lists
  // (never a master).
  static constexpr uint32_t kernel_lists(bool master, StateCodec codec, bool coded) {
    return list_bit(kMuonUpdate) | list_bit(kMuonGrad) | list_bit(kMuonMomentumBuffer) | list_bit(kMuonStep) |
           (master ? list_bit(kMuonMaster) : 0u) | (codec == StateCodec::kInt8 ? list_bit(kMuonMomentumBufferScale) : 0u) |
           (coded ? list_bit(kMuonRoundingId) : 0u);
  }
  using CpuChunk = void (*)(const MuonCall&, const MuonCoefficients&, int64_t tensor, int64_t begin,
                            int64_t end);
  c10::Device device;
  DType param_dtype;  // the updates': float32 or bfloat16
  DType grad_dtype;
  MasterKind master_kind;  // always kNone
  TensorLists<kMuonLists> lists;
  MuonHyperparameters hyper;
  StepInputs inputs;
  StateCodec state_codec = StateCodec::kFloat32;  // of the momentum buffers ([note: state codecs])
  StochasticRounding rounding;  // enabled is always false: the seed keys the buffers' codes
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE MuonCoefficients step_coefficients(const MuonHyperparameters& h, double, float) {
  return muon_coefficients(h.momentum, h.nesterov);
}

FUSEDAMP_NAMESPACE_END

// Muon's momentum per element (torch.optim.Muon's order): the buffer lerped toward the grad, and
// the update that Newton-Schulz orthogonalizes (the Nesterov blend or the buffer itself).
#pragma once

#include "fusedamp/math/master.h"

namespace fusedamp {

struct MuonCoefficients {
  float momentum;
  bool nesterov;
};

struct MuonTensorPointers {
  void* param;  // the update it writes, in the orthogonalization's dtype (the op's "params")
  void* grad;
  void* master;            // always null: an update has no master
  float* momentum_buffer;
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE MuonCoefficients muon_coefficients(double momentum, bool nesterov) {
  return {float(momentum), nesterov};
}

// torch.lerp(start, end, weight) as ATen computes it: from the nearer end, so that weights near 1
// keep the end's bits. The branch is a bit select (vectorizable host loops).
FUSEDAMP_HOST_DEVICE float torch_lerp(float start, float end, float weight) {
  const float from_start = start + weight * (end - start);
  const float from_end = end - (end - start) * (1.0f - weight);
  return select_float(weight < 0.5f, from_start, from_end);
}

// buffer.lerp_(grad, 1 - momentum); update = grad.lerp(buffer, momentum) with nesterov, else the
// buffer. The buffer starts at zero, as torch's.
FUSEDAMP_HOST_DEVICE void muon_momentum_update(float& update, float grad, float& momentum_buffer,
                                               const MuonCoefficients& c) {
  momentum_buffer = torch_lerp(momentum_buffer, grad, 1.0f - c.momentum);
  update = select_float(c.nesterov, torch_lerp(grad, momentum_buffer, c.momentum), momentum_buffer);
}

// U is the update's dtype; the update is written, never read.
template <DType U, DType G, MasterKind M>
FUSEDAMP_HOST_DEVICE void muon_element(const MuonTensorPointers& t, int64_t index, const MuonCoefficients& c,
                                       float grad_multiplier, bool write_grad) {
  const float grad = prepare_grad<G>(t.grad, index, grad_multiplier, write_grad);
  float update = 0.0f;
  muon_momentum_update(update, grad, t.momentum_buffer[index], c);
  store_master<U, M>(t.param, t.master, index, update);
}

FUSEDAMP_NAMESPACE_END

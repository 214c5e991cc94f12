// SGD (momentum, dampening, nesterov, weight decay, maximize) per-element update, torch's order.
#pragma once

#include "fusedamp/math/master.h"

namespace fusedamp {

struct SgdCoefficients {
  float lr;
  float weight_decay;
  float momentum;             // 0 = no momentum buffer (buffers not read or written)
  float one_minus_dampening;
  float grad_sign;            // -1 with maximize
  bool nesterov;
  bool first_step;            // the buffer starts as the gradient itself
};

struct SgdTensorPointers {
  void* param;
  void* grad;
  void* master;
  float* momentum_buffer;  // null without momentum
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE SgdCoefficients sgd_coefficients(double lr, double momentum, double dampening,
                                                      double weight_decay, bool nesterov,
                                                      bool maximize, bool first_step) {
  SgdCoefficients c;
  c.lr = float(lr);
  c.weight_decay = float(weight_decay);
  c.momentum = float(momentum);
  c.one_minus_dampening = float(1.0 - dampening);
  c.grad_sign = maximize ? -1.0f : 1.0f;
  c.nesterov = nesterov;
  c.first_step = first_step;
  return c;
}

// maximize negates the gradient before weight decay, as torch.optim.SGD does. The flags are
// bit selects, not branches, so that host loops over this stay vectorizable.
FUSEDAMP_HOST_DEVICE void sgd_update(float& param, float grad, float& momentum_buffer,
                                     bool has_momentum, const SgdCoefficients& c) {
  grad *= c.grad_sign;
  const float decayed = grad + c.weight_decay * param;
  grad = select_float(c.weight_decay != 0.0f, decayed, grad);
  if (has_momentum) {
    const float blended = c.momentum * momentum_buffer + c.one_minus_dampening * grad;
    momentum_buffer = select_float(c.first_step, grad, blended);
    const float look_ahead = grad + c.momentum * momentum_buffer;
    grad = select_float(c.nesterov, look_ahead, momentum_buffer);
  }
  param -= c.lr * grad;
}

// has_momentum must equal (c.momentum != 0); it is a separate argument so that callers can
// make it a compile-time constant.
template <DType P, DType G, MasterKind M>
FUSEDAMP_HOST_DEVICE void sgd_element(const SgdTensorPointers& t, int64_t index,
                                      const SgdCoefficients& c, float grad_multiplier,
                                      bool write_grad, bool has_momentum) {
  const float grad = prepare_grad<G>(t.grad, index, grad_multiplier, write_grad);
  float param = load_master<P, M>(t.param, t.master, index);
  float buffer = has_momentum ? t.momentum_buffer[index] : 0.0f;
  sgd_update(param, grad, buffer, has_momentum, c);
  if (has_momentum) t.momentum_buffer[index] = buffer;
  store_master<P, M>(t.param, t.master, index, param);
}

FUSEDAMP_NAMESPACE_END

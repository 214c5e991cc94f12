// AdamW per-element update in PyTorch's order, shared by the CPU and CUDA kernels.
#pragma once

#include <math.h>

#include "fusedamp/math/master.h"

namespace fusedamp {

// Per-tensor constants of one step, computed once (in double) from the hyperparameters and the
// step count the update is for, then used in float by every element.
struct AdamWCoefficients {
  float decay_factor;           // 1 - lr * weight_decay
  float beta1;
  float exp_avg_grad_weight;    // 1 - beta1, negated with maximize
  float beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^step)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
};

// Raw pointers of one tensor of an AdamW call (max_exp_avg_sq only with amsgrad, master only
// with a MasterKind other than kNone).
struct AdamWTensorPointers {
  void* param;
  void* grad;
  void* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
};

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE AdamWCoefficients adamw_coefficients(double lr, double beta1, double beta2,
                                                          double eps, double weight_decay,
                                                          bool maximize, double step) {
  AdamWCoefficients c;
  c.decay_factor = float(1.0 - lr * weight_decay);
  c.beta1 = float(beta1);
  c.exp_avg_grad_weight = maximize ? -float(1.0 - beta1) : float(1.0 - beta1);
  c.beta2 = float(beta2);
  c.one_minus_beta2 = float(1.0 - beta2);
  c.step_size = float(lr / (1.0 - pow(beta1, step)));
  c.inv_bias_correction2_sqrt = float(1.0 / sqrt(1.0 - pow(beta2, step)));
  c.eps = float(eps);
  return c;
}

// Decoupled weight decay on the old param first (param * (1 - lr * wd), as torch), then the
// moments, then the bias-corrected step with sqrt(v) / sqrt(1 - beta2^t) + eps: the order of
// torch.optim.AdamW. The division by sqrt(1 - beta2^t) is a multiply by its reciprocal: the
// step is bound by the divider (a sqrt and two divisions per element), and this one costs at
// most an ulp of denom. maximize negates the grad, which
// only exp_avg sees with its sign (exp_avg_sq squares it): the sign rides on exp_avg's weight,
// one multiply fewer per element with the same bits (negation is exact in every product).
FUSEDAMP_HOST_DEVICE void adamw_update(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                       float& max_exp_avg_sq, bool amsgrad,
                                       const AdamWCoefficients& c) {
  param *= c.decay_factor;
  exp_avg = c.beta1 * exp_avg + c.exp_avg_grad_weight * grad;
  exp_avg_sq = c.beta2 * exp_avg_sq + c.one_minus_beta2 * grad * grad;
  float second_moment = exp_avg_sq;
  if (amsgrad) {
    max_exp_avg_sq = max_exp_avg_sq > exp_avg_sq ? max_exp_avg_sq : exp_avg_sq;
    second_moment = max_exp_avg_sq;
  }
  const float denom = sqrtf(second_moment) * c.inv_bias_correction2_sqrt + c.eps;
  param -= c.step_size * exp_avg / denom;
}

// The whole step for element `index`: the one function both backends loop over.
template <DType P, DType G, MasterKind M>
FUSEDAMP_HOST_DEVICE void adamw_element(const AdamWTensorPointers& t, int64_t index,
                                        const AdamWCoefficients& c, float grad_multiplier,
                                        bool write_grad, bool amsgrad) {
  const float grad = prepare_grad<G>(t.grad, index, grad_multiplier, write_grad);
  float param = load_master<P, M>(t.param, t.master, index);
  float exp_avg = t.exp_avg[index];
  float exp_avg_sq = t.exp_avg_sq[index];
  float max_exp_avg_sq = amsgrad ? t.max_exp_avg_sq[index] : 0.0f;
  adamw_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad, c);
  t.exp_avg[index] = exp_avg;
  t.exp_avg_sq[index] = exp_avg_sq;
  if (amsgrad) t.max_exp_avg_sq[index] = max_exp_avg_sq;
  store_master<P, M>(t.param, t.master, index, param);
}

FUSEDAMP_NAMESPACE_END

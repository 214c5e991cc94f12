// Per-chunk CPU kernels: simple loops over the shared per-element math, which g++ vectorizes
// for the ISA of the including translation unit. Never include this from anywhere else.
#pragma once

#include "cpu/kernels.h"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/unscale.h"

#ifndef FUSEDAMP_KERNEL_TABLE
#error "define FUSEDAMP_KERNEL_TABLE (the KernelTable this ISA build defines) before including"
#endif

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

template <DType G>
bool unscale_range(void* grad, int64_t begin, int64_t end, float inv_scale) {
  auto* typed = static_cast<storage_t<G>*>(grad);
  int32_t found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t i = begin; i < end; ++i) found |= int32_t(unscale_element<G>(typed, i, inv_scale));
  return found != 0;
}

template <DType G>
bool check_range(const void* grad, int64_t begin, int64_t end, float multiplier,
                 float* sum_of_squares) {
  const auto* typed = static_cast<const storage_t<G>*>(grad);
  int32_t found = 0;
  float sum = 0.0f;
#pragma omp simd reduction(| : found) reduction(+ : sum)
  for (int64_t i = begin; i < end; ++i) {
    float square = 0.0f;
    found |= int32_t(check_element<G>(typed, i, multiplier, square));
    sum += square;
  }
  *sum_of_squares = sum;
  return found != 0;
}

template <DType P, DType G, MasterKind M, bool kAmsgrad, bool kWriteGrad>
void adamw_range(const AdamWTensorPointers& tensor, const AdamWKernelArgs& args, int64_t begin,
                 int64_t end) {
  const AdamWTensorPointers t = tensor;
  const AdamWCoefficients c = args.coefficients;
  const float multiplier = args.grad_multiplier;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    adamw_element<P, G, M>(t, i, c, multiplier, kWriteGrad, kAmsgrad);
  }
}

template <DType P, DType G, MasterKind M, bool kHasMomentum, bool kWriteGrad>
void sgd_range(const SgdTensorPointers& tensor, const SgdKernelArgs& args, int64_t begin,
               int64_t end) {
  const SgdTensorPointers t = tensor;
  const SgdCoefficients c = args.coefficients;
  const float multiplier = args.grad_multiplier;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    sgd_element<P, G, M>(t, i, c, multiplier, kWriteGrad, kHasMomentum);
  }
}

bool unscale(void* grad, DType dtype, int64_t begin, int64_t end, float inv_scale) {
  bool found = false;
  with_float_dtype(dtype, [&](auto g) { found = unscale_range<g.value>(grad, begin, end, inv_scale); });
  return found;
}

bool check(const void* grad, DType dtype, int64_t begin, int64_t end, float multiplier,
           float* sum_of_squares) {
  bool found = false;
  with_float_dtype(dtype, [&](auto g) {
    found = check_range<g.value>(grad, begin, end, multiplier, sum_of_squares);
  });
  return found;
}

void adamw(const AdamWTensorPointers& tensor, const AdamWKernelArgs& args, int64_t begin,
           int64_t end) {
  with_float_dtype(args.param_dtype, [&](auto p) {
    with_float_dtype(args.grad_dtype, [&](auto g) {
      with_master_kind<p.value>(args.master_kind, [&](auto m) {
        with_bool(args.amsgrad, [&](auto amsgrad) {
          with_bool(args.write_grad, [&](auto write_grad) {
            adamw_range<p.value, g.value, m.value, amsgrad.value, write_grad.value>(tensor, args,
                                                                                    begin, end);
          });
        });
      });
    });
  });
}

void sgd(const SgdTensorPointers& tensor, const SgdKernelArgs& args, int64_t begin, int64_t end) {
  with_float_dtype(args.param_dtype, [&](auto p) {
    with_float_dtype(args.grad_dtype, [&](auto g) {
      with_master_kind<p.value>(args.master_kind, [&](auto m) {
        with_bool(args.coefficients.momentum != 0.0f, [&](auto has_momentum) {
          with_bool(args.write_grad, [&](auto write_grad) {
            sgd_range<p.value, g.value, m.value, has_momentum.value, write_grad.value>(
                tensor, args, begin, end);
          });
        });
      });
    });
  });
}

}  // namespace FUSEDAMP_ISA

const KernelTable FUSEDAMP_KERNEL_TABLE = {FUSEDAMP_ISA_NAME, unscale, check, adamw, sgd};

}  // namespace fusedamp::cpu

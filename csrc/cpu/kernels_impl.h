// Per-chunk CPU kernels: simple loops over the shared per-element math, which g++ vectorizes
// for the ISA of the including translation unit. Never include this from anywhere else.
#pragma once

#include "cpu/kernels.h"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/unscale.h"

#ifndef FUSEDAMP_KERNEL_TABLE
#error "define FUSEDAMP_KERNEL_TABLE (the KernelTable this ISA build defines) before including"
#endif

// FUSEDAMP_F16C_LANES (8 or 16, set by the AVX2 / AVX-512 builds on x86-64): convert fp16 with
// the hardware instructions instead of the bit-level code of math/dtypes.h.
#ifndef FUSEDAMP_F16C_LANES
#define FUSEDAMP_F16C_LANES 0
#endif

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// [note: fp16 staging] g++ vectorizes the bf16 conversions well but not the fp16 ones, and torch
// converts fp16 with F16C. So where the ISA has F16C, the kernels convert fp16 data tile by tile
// into fp32 buffers with the conversion instructions (round to nearest even, like dtypes.h: the
// results are identical), run the same per-element math on the buffers as fp32, and convert back.
constexpr bool kStageFp16 = FUSEDAMP_F16C_LANES > 0;
constexpr int64_t kStageTile = 1024;

inline void fp16_tile_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  for (; i + 16 <= n; i += 16) {
    // The maskz forms: the plain ones trip a -Wmaybe-uninitialized false positive in gcc 12.
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_maskz_cvtph_ps(__mmask16(0xffff), halves));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = fp16_to_float(src[i]);
}

inline void float_tile_to_fp16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES == 16
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_maskz_cvtps_ph(__mmask16(0xffff), _mm512_loadu_ps(src + i),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif FUSEDAMP_F16C_LANES == 8
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_fp16(src[i]);
}

// The element type the math sees after staging.
template <DType T>
constexpr DType staged = (kStageFp16 && T == DType::kFloat16) ? DType::kFloat32 : T;

// Pointers of one optimizer tensor moved to element `offset`, with fp16 params and grads
// replaced by fp32 tile buffers (see [note: fp16 staging]); load_param says whether the math
// reads the param (it does not when an fp32 master holds the value).
template <DType P, DType G, MasterKind M, typename Pointers>
Pointers staged_tile(const Pointers& t, int64_t offset, int64_t n, float* param_tile,
                     float* grad_tile) {
  Pointers s = t;
  s.param = static_cast<storage_t<P>*>(t.param) + offset;
  s.grad = static_cast<storage_t<G>*>(t.grad) + offset;
  if constexpr (M != MasterKind::kNone) s.master = static_cast<master_storage_t<M>*>(t.master) + offset;
  if constexpr (P != staged<P>) {
    if constexpr (M == MasterKind::kNone) fp16_tile_to_float(static_cast<uint16_t*>(s.param), param_tile, n);
    s.param = param_tile;
  }
  if constexpr (G != staged<G>) {
    fp16_tile_to_float(static_cast<uint16_t*>(s.grad), grad_tile, n);
    s.grad = grad_tile;
  }
  return s;
}

// Writes a tile's staged fp16 param (and grad, when the step writes grads) back.
template <DType P, DType G, typename Pointers>
void unstage_tile(const Pointers& t, int64_t offset, int64_t n, const float* param_tile,
                  const float* grad_tile, bool write_grad) {
  if constexpr (P != staged<P>) float_tile_to_fp16(param_tile, static_cast<uint16_t*>(t.param) + offset, n);
  if constexpr (G != staged<G>) {
    if (write_grad) float_tile_to_fp16(grad_tile, static_cast<uint16_t*>(t.grad) + offset, n);
  }
}

template <DType G>
bool unscale_range(void* grad, int64_t begin, int64_t end, float inv_scale) {
  if constexpr (G != staged<G>) {
    auto* halves = static_cast<uint16_t*>(grad);
    float tile[kStageTile];
    bool found = false;
    for (int64_t first = begin; first < end; first += kStageTile) {
      const int64_t n = std::min(kStageTile, end - first);
      fp16_tile_to_float(halves + first, tile, n);
      found |= unscale_range<DType::kFloat32>(tile, 0, n, inv_scale);
      float_tile_to_fp16(tile, halves + first, n);
    }
    return found;
  }
  auto* typed = static_cast<storage_t<G>*>(grad);
  int32_t found = 0;
#pragma omp simd reduction(| : found)
  for (int64_t i = begin; i < end; ++i) found |= int32_t(unscale_element<G>(typed, i, inv_scale));
  return found != 0;
}

template <DType G>
bool check_range(const void* grad, int64_t begin, int64_t end, float multiplier,
                 float* sum_of_squares) {
  if constexpr (G != staged<G>) {
    const auto* halves = static_cast<const uint16_t*>(grad);
    float tile[kStageTile];
    bool found = false;
    float sum = 0.0f;
    for (int64_t first = begin; first < end; first += kStageTile) {
      const int64_t n = std::min(kStageTile, end - first);
      fp16_tile_to_float(halves + first, tile, n);
      float tile_sum = 0.0f;
      found |= check_range<DType::kFloat32>(tile, 0, n, multiplier, &tile_sum);
      sum += tile_sum;
    }
    *sum_of_squares = sum;
    return found;
  }
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
  if constexpr (P != staged<P> || G != staged<G>) {
    float param_tile[kStageTile], grad_tile[kStageTile];
    for (int64_t first = begin; first < end; first += kStageTile) {
      const int64_t n = std::min(kStageTile, end - first);
      AdamWTensorPointers tile = staged_tile<P, G, M>(tensor, first, n, param_tile, grad_tile);
      tile.exp_avg += first;
      tile.exp_avg_sq += first;
      if (kAmsgrad) tile.max_exp_avg_sq += first;
      adamw_range<staged<P>, staged<G>, M, kAmsgrad, kWriteGrad>(tile, args, 0, n);
      unstage_tile<P, G>(tensor, first, n, param_tile, grad_tile, kWriteGrad);
    }
    return;
  }
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
  if constexpr (P != staged<P> || G != staged<G>) {
    float param_tile[kStageTile], grad_tile[kStageTile];
    for (int64_t first = begin; first < end; first += kStageTile) {
      const int64_t n = std::min(kStageTile, end - first);
      SgdTensorPointers tile = staged_tile<P, G, M>(tensor, first, n, param_tile, grad_tile);
      if (kHasMomentum) tile.momentum_buffer += first;
      sgd_range<staged<P>, staged<G>, M, kHasMomentum, kWriteGrad>(tile, args, 0, n);
      unstage_tile<P, G>(tensor, first, n, param_tile, grad_tile, kWriteGrad);
    }
    return;
  }
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

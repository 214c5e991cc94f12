// The plain description of one GEMM that the torch-facing layer (gemm.cpp) hands to the kernels.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include <type_traits>

#include "fusedamp/gemm/tiles.h"

namespace fusedamp::gemm {

// out (M, N) = act(A (M, K) @ B (K, N) + bias), fp32 accumulation. A and B hold fp16 or bf16 (the
// kernel's template type); every pointer is 16-byte aligned and every leading dimension a multiple
// of 8 elements (gemm.cpp routes other inputs to the ATen reference).
struct GemmParams {
  const void* a;       // A element (m, k) at a[m * lda + k] if a_k_major, else a[k * lda + m]
  const void* b;       // B element (k, n) at b[n * ldb + k] if b_k_major, else b[k * ldb + n]
  const void* bias;    // (N,) in the input type, or fp32 when bias_fp32; nullptr: no bias
  void* out;           // (M, N) row-major, leading dimension N; fp32 when out_fp32, else input type
  void* preact;        // like out, receives acc + bias before the activation; nullptr: not kept
  int64_t lda;         // leading dimension of A, in elements
  int64_t ldb;         // leading dimension of B, in elements
  int32_t m;           // rows of A and out (>= 1)
  int32_t n;           // columns of B and out (>= 1)
  int32_t k;           // the reduction length (>= 1)
  bool a_k_major;      // A's k index has unit stride (row-major A)
  bool b_k_major;      // B's k index has unit stride (B is a transposed row-major (N, K) matrix)
  bool bias_fp32;      // bias holds float32 rather than the input type
  bool out_fp32;       // out and preact hold float32 rather than the input type
  Activation activation;  // applied to acc + bias in fp32
};

// Calls fn(std::integral_constant<Activation, act>{}) for the run-time activation `act`.
template <typename Fn>
void with_activation(Activation act, Fn&& fn) {
  using A = Activation;
  switch (act) {
    case A::kRelu: return fn(std::integral_constant<A, A::kRelu>{});
    case A::kGelu: return fn(std::integral_constant<A, A::kGelu>{});
    case A::kGeluTanh: return fn(std::integral_constant<A, A::kGeluTanh>{});
    default: return fn(std::integral_constant<A, A::kNone>{});
  }
}

// Calls fn(a_k_major, b_k_major, has_bias, activation) with the call's operand layouts and
// epilogue as compile-time constants (std::bool_constant, std::integral_constant<Activation>), so
// that a launcher picks its kernel instance once per call and each instance holds only the
// epilogue code it runs.
template <typename Fn>
void with_kernel_instance(const GemmParams& p, Fn&& fn) {
  auto with_bool = [](bool value, auto&& next) {
    if (value) next(std::true_type{});
    else next(std::false_type{});
  };
  with_bool(p.a_k_major, [&](auto a_k_major) {
    with_bool(p.b_k_major, [&](auto b_k_major) {
      with_bool(p.bias != nullptr, [&](auto has_bias) {
        with_activation(p.activation, [&](auto act) { fn(a_k_major, b_k_major, has_bias, act); });
      });
    });
  });
}

// Launchers (one translation unit per kernel family and input type). `sm_count` sizes the
// persistent sm90 grid. Both throw a c10::Error on a launch failure.
void launch_sm80_fp16(const GemmParams& p, cudaStream_t stream);
void launch_sm80_bf16(const GemmParams& p, cudaStream_t stream);
void launch_sm90_fp16(const GemmParams& p, Sm90Schedule schedule, int sm_count,
                      cudaStream_t stream);
void launch_sm90_bf16(const GemmParams& p, Sm90Schedule schedule, int sm_count,
                      cudaStream_t stream);

// Whether this build holds mma.sync code the current device runs: SASS for its arch (sm_80 SASS
// runs on sm_8x, not on sm_90 or later) or PTX the driver compiles for it, made for arch 8.0 or
// later (code for an older arch, 7.5 say, has an empty kernel body).
bool sm80_kernels_built();
// Whether this build holds real sm_90a wgmma code the current device runs (it does not when 9.0a
// was not a target, nor on any GPU but sm_90).
bool sm90_kernels_built();

}  // namespace fusedamp::gemm

// Element storage types and exact float <-> fp16/bf16 conversions (round to nearest even),
// written with integer and float operations only so that g++ vectorizes them on the host.
#pragma once

#include <stdint.h>
#include <string.h>

#include "fusedamp/macros.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace fusedamp {

// The element types a kernel can read or write. Kernels see raw storage, never at::Tensor.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt16 = 3 };

template <DType T> struct StorageOf { using type = uint16_t; };
template <> struct StorageOf<DType::kFloat32> { using type = float; };
template <DType T> using storage_t = typename StorageOf<T>::type;

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

FUSEDAMP_HOST_DEVICE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// True for +-inf and NaN: the exponent field is all ones.
FUSEDAMP_HOST_DEVICE bool is_non_finite(float value) {
  return (float_bits(value) & 0x7f800000u) == 0x7f800000u;
}

// cond ? if_true : if_false on bit patterns, written with masks so that g++ keeps loops that
// use it branch-free (and therefore vectorizable) on every ISA.
FUSEDAMP_HOST_DEVICE uint32_t select_bits(bool cond, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - uint32_t(cond);
  return (if_true & mask) | (if_false & ~mask);
}

FUSEDAMP_HOST_DEVICE float select_float(bool cond, float if_true, float if_false) {
#if defined(__CUDA_ARCH__)
  return cond ? if_true : if_false;
#else
  return float_from_bits(select_bits(cond, float_bits(if_true), float_bits(if_false)));
#endif
}

FUSEDAMP_HOST_DEVICE float bf16_to_float(uint16_t bits) { return float_from_bits(uint32_t(bits) << 16); }

// Round to nearest even on the bit pattern; NaN stays a (quiet) NaN.
FUSEDAMP_HOST_DEVICE uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return uint16_t(select_bits(nan, (bits >> 16) | 0x40u, rounded));
}

FUSEDAMP_HOST_DEVICE float fp16_to_float(uint16_t half) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(half));
#else
  // Shift the fp16 exponent/mantissa into fp32 position and rebias with one multiply;
  // subnormals are rebuilt exactly by subtracting a magic 0.5 (2^-1 with the mantissa below it).
  const uint32_t widened = uint32_t(half) << 16;
  const uint32_t sign = widened & 0x80000000u;
  const uint32_t doubled = widened + widened;  // drops the sign bit
  const float normal = float_from_bits((doubled >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  const float subnormal = float_from_bits((doubled >> 17) | (126u << 23)) - 0.5f;
  const bool is_subnormal = doubled < (1u << 27);
  return float_from_bits(sign | select_bits(is_subnormal, float_bits(subnormal), float_bits(normal)));
#endif
}

FUSEDAMP_HOST_DEVICE uint16_t float_to_fp16(float value) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(value));
#else
  // Let the FPU do the rounding: scaling up then down makes the fp32 add below round at the
  // fp16 mantissa position (IEEE round to nearest even), overflow saturates to inf.
  float magnitude = (__builtin_fabsf(value) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t bits = float_bits(value);
  const uint32_t doubled = bits + bits;
  const uint32_t sign = bits & 0x80000000u;
  uint32_t bias = doubled & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  magnitude = float_from_bits((bias >> 1) + 0x07800000u) + magnitude;
  const uint32_t rounded = float_bits(magnitude);
  const uint32_t packed = ((rounded >> 13) & 0x7c00u) + (rounded & 0x0fffu);
  // NaN: quiet, with the top of its payload, as the F16C conversion the x86 builds use does.
  const uint32_t nan = 0x7e00u | ((bits >> 13) & 0x3ffu);
  return uint16_t((sign >> 16) | select_bits(doubled > 0xff000000u, nan, packed));
#endif
}

template <DType T>
FUSEDAMP_HOST_DEVICE float load_float(const storage_t<T>* ptr, int64_t index) {
  if constexpr (T == DType::kFloat32) {
    return ptr[index];
  } else if constexpr (T == DType::kFloat16) {
    return fp16_to_float(ptr[index]);
  } else {
    static_assert(T == DType::kBFloat16, "load_float: unsupported element type");
    return bf16_to_float(ptr[index]);
  }
}

template <DType T>
FUSEDAMP_HOST_DEVICE void store_float(storage_t<T>* ptr, int64_t index, float value) {
  if constexpr (T == DType::kFloat32) {
    ptr[index] = value;
  } else if constexpr (T == DType::kFloat16) {
    ptr[index] = float_to_fp16(value);
  } else {
    static_assert(T == DType::kBFloat16, "store_float: unsupported element type");
    ptr[index] = float_to_bf16(value);
  }
}

FUSEDAMP_NAMESPACE_END

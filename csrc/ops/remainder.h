// The call structs of split_bf16_remainder and join_bf16_remainder (CPU only), made by
// ops/remainder.cpp.
#pragma once

#include <c10/core/Device.h>

#include <stdint.h>

namespace fusedamp {

struct SplitRemainderCall {
  static constexpr const char* kOp = "split_bf16_remainder";
  using CpuChunk = void (*)(const SplitRemainderCall&, int64_t begin, int64_t end);
  c10::Device device;
  const float* master;
  uint16_t* param;  // bf16 bits
  int16_t* remainder;
  int64_t numel;
};

struct JoinRemainderCall {
  static constexpr const char* kOp = "join_bf16_remainder";
  using CpuChunk = void (*)(const JoinRemainderCall&, int64_t begin, int64_t end);
  c10::Device device;
  const uint16_t* param;  // bf16 bits
  const int16_t* remainder;
  float* master;
  int64_t numel;
};

}  // namespace fusedamp

// The call structs of encode_state and decode_state (CPU only): a state tensor to its 8-bit block
// codes and scales and back (math/codec.h), made by ops/codec.cpp.
#pragma once

#include <c10/core/Device.h>

#include <stdint.h>

namespace fusedamp {

struct EncodeStateCall {
  static constexpr const char* kOp = "encode_state";
  // Encodes the whole blocks [first_block, end_block).
  using CpuChunk = void (*)(const EncodeStateCall&, int64_t first_block, int64_t end_block);
  c10::Device device;
  const float* values;
  uint8_t* codes;
  uint16_t* scales;  // bf16 bits ([note: block codes])
  int64_t numel;
  bool is_signed;
};

struct DecodeStateCall {
  static constexpr const char* kOp = "decode_state";
  using CpuChunk = void (*)(const DecodeStateCall&, int64_t first_block, int64_t end_block);
  c10::Device device;
  const uint8_t* codes;
  const uint16_t* scales;  // bf16 bits
  float* values;
  int64_t numel;
  bool is_signed;
};

}  // namespace fusedamp

// CPU kernels of encode_state and decode_state (built once per ISA, see setup.py): block loops
// over the vector codes of cpu/codec.h, run in parallel by the drivers.
#include "ops/codec.h"

#include "cpu/codec.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

template <typename Call, typename Block>
void for_blocks(const Call& call, int64_t first_block, int64_t end_block, Block&& block) {
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t begin = b * kCodecBlock;
    const int64_t left = call.numel - begin;
    block(b, begin, left < kCodecBlock ? left : kCodecBlock);
  }
}

void encode_chunk(const EncodeStateCall& call, int64_t first_block, int64_t end_block) {
  for_blocks(call, first_block, end_block, [&](int64_t b, int64_t begin, int64_t n) {
    if (call.is_signed) {
      encode_state_tile<true>(call.values + begin, n, call.codes + begin, call.scales + b);
    } else {
      encode_state_tile<false>(call.values + begin, n, call.codes + begin, call.scales + b);
    }
  });
}

void decode_chunk(const DecodeStateCall& call, int64_t first_block, int64_t end_block) {
  for_blocks(call, first_block, end_block, [&](int64_t b, int64_t begin, int64_t n) {
    const uint16_t scale = call.scales[b];
    if (call.is_signed) {
      decode_state_tile<true>(call.codes + begin, block_decode_of<true>(call.codes + begin, scale, n), n,
                              call.values + begin);
    } else {
      decode_state_tile<false>(call.codes + begin, block_decode_of<false>(call.codes + begin, scale, n), n,
                               call.values + begin);
    }
  });
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(EncodeStateCall, encode_chunk);
FUSEDAMP_REGISTER_CPU_CHUNK(DecodeStateCall, decode_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

// Chunks of blocks: kChunkSize is a whole number of codec blocks.
template <typename Call>
void run_blocks(const Call& call) {
  static_assert(kChunkSize % kCodecBlock == 0, "CPU chunks must hold whole codec blocks");
  const typename Call::CpuChunk chunk = cpu_chunk<Call>();
  for_each_chunk({call.numel}, [&](int64_t, int64_t begin, int64_t end) {
    chunk(call, begin / kCodecBlock, codec_blocks(end));
  });
}

void encode_cpu(const EncodeStateCall& call) { run_blocks(call); }
void decode_cpu(const DecodeStateCall& call) { run_blocks(call); }

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, EncodeStateCall, encode_cpu);
FUSEDAMP_REGISTER_KERNEL(CPU, DecodeStateCall, decode_cpu);
#endif

}  // namespace fusedamp::cpu

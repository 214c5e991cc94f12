// Block staging of the coded optimizer steps ([note: block staging]), in codec blocks and groups:
// a state's codec block as fp32, a group of kBlockGroup values at a time, through its codec
// (StagedState, StateBlock); a param's values and grads likewise (stage_value_block,
// stage_grad_block; half params rounded back stochastically); and what every step walks a chunk
// with, a codec block at a time: for_each_codec_block and the prefetches of the blocks ahead
// ([note: block prefetch]). Included by the cpu/ headers and csrc/cpu/kernels/*.cpp only, after
// their ISA preamble.
#pragma once

#include "cpu/codec.h"
#include "cpu/isa.h"
#include "cpu/staging.h"
#include "fusedamp/math/codec.h"
#include "fusedamp/math/master.h"
#include "fusedamp/math/stochastic.h"

// [note: block staging] The optimizer modes with coded states (bf16 or 8-bit moments,
// math/codec.h) or stochastically rounded params run a chunk one codec block (kCodecBlock
// elements) at a time, in groups of kBlockGroup ([note: group staging]): each state, param and
// grad of a group is staged as fp32 here, the optimizer's math runs on them, and they are stored
// back through the same codecs. The codec is a parameter of these helpers, so every optimizer
// gets every codec at once, and a block's scale is computed from the whole block after its
// update.
namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {

// Values a coded step stages at a time inside a codec block: its conversions, math and stores
// stay in registers, and the math's divides and square roots overlap the codec work around them
// ([note: group staging]). Two vectors a state on AVX-512, four on AVX2: one loop body then holds
// independent divide chains, which ran faster than 16 values on both builds.
constexpr int64_t kBlockGroup = 32;

// [note: group staging] A coded step first ran each stage over a whole block: decode the
// moments, run the math, encode. The math's vdivps and vsqrtps (about 22 cycles per 16 values
// on AVX-512) then ran alone while the codec's integer work waited. Now one loop body takes
// kBlockGroup values through decode, math and the block maximum, and encodes the same group of
// the block before (whose maximum, hence scale, is final), so the out-of-order core overlaps the
// divider with all the codec work; a chunk's last block is encoded after its loop. Each of those
// steps made the int8 step faster against the fp32-moment one: grouping, then the encode one block
// behind. With the earlier codes the loop was then bound by its vector ports, not by the divider
// (llvm-mca on the AVX-512 loop counted more uops per 16 values on each of ports 0 and 5 than the
// divider's cycles), so the vector codec drops what a block does not need (kPlain encodes, decodes
// without the special codes' check). The tapered codes take about twice the codec uops, and the
// step is bound by them: vector instructions added to the encoder slow it about in proportion.
// On AVX2 dropping single ones pays (shifts by a vector of counts, no lower clamp, a one-
// instruction mask test, zero codes by an andnot); on AVX-512 the same cuts, or constants made once
// a block instead of once a group, left the step's time unchanged or slower. Two to four
// instructions fewer per vector on both (the position by one shift and one add of
// real_code_offset, no top clamp in plain blocks, the unsigned smallest code by a maximum) paid
// on both. Taking the draws' hash once per vector instead of per lane ([note: dither phases]) made
// both faster, and once per block, a vector of them at a time ([note: block phases]), again.

// One codec block of an optimizer state as fp32, a group of values at a time: an fp32 state in
// place; a bf16 one decoded into a tile and stored back group by group; an int8 one decoded
// likewise, its groups' maximum folded in as they come back, and its codes written while the
// next block runs (encode_pending). Made by StagedState::begin_block as a local of the block
// loop, so that its pointers and maximum stay in registers: as members, the code stores
// (uint8_t, which may alias anything) made the compiler reload them for every group. It has a
// constructor so that `StateBlock{}` sets each member by its initializer: as an aggregate it was
// zeroed whole first, which g++ did with `rep stosq` on the AVX2 build, three a block in the
// half-param steps (bf16 params + remainder + int8 moments).
template <StateCodec C, bool kSigned, DrawShare S = DrawShare::kWhole>
struct StateBlock {
  void* state = nullptr;                  // the state at the block's first element
  float* values = nullptr;                // the block's fp32 values: the state itself, or a tile
  const uint32_t* phases = nullptr;       // bf16: the block's draws ([note: block phases])
  BlockDecode decode{};                   // int8: the block's scale and how its codes decode
  const float* pending_values = nullptr;  // int8: the block before, to encode; null if none
  uint8_t* pending_codes = nullptr;
  const uint32_t* pending_phases = nullptr;  // int8: the draws of the block before
  BlockScale pending_scale{};
  BlockStats<kSigned> stats;

  [[gnu::always_inline]] StateBlock() {}

  // The values of the group of n at `offset` in the block.
  [[gnu::always_inline]] float* stage(int64_t offset, int64_t n) {
    if constexpr (C == StateCodec::kBFloat16) {
      bf16_tile_to_float(static_cast<const uint16_t*>(state) + offset, values + offset, n);
    } else if constexpr (C == StateCodec::kInt8) {
      decode_state_tile<kSigned>(static_cast<const uint8_t*>(state) + offset, decode, n, values + offset);
    }
    return values + offset;
  }

  // Takes back the group that stage() gave, after the math updated it: a bf16 state rounded with
  // its block's draws (PhasedDraws, or the TiledDraws of a shared draw), an int8 one folded into
  // the block's statistics.
  [[gnu::always_inline]] void unstage(int64_t offset, int64_t n) {
    unstage(offset, n, PhasedDraws{phases, offset});
  }

  template <typename Draws>
  [[gnu::always_inline]] void unstage(int64_t offset, int64_t n, Draws draws) {
    if constexpr (C == StateCodec::kBFloat16) {
      float_tile_to_bf16_state<S>(values + offset, static_cast<uint16_t*>(state) + offset, n, draws);
    } else if constexpr (C == StateCodec::kInt8) {
      stats.fold(values + offset, n);
    }
  }

  // Writes the codes of values [offset, offset + n) of the block before this one, if any, rounded
  // with its draws (as unstage).
  [[gnu::always_inline]] void encode_pending(int64_t offset, int64_t n) {
    encode_pending(offset, n, PhasedDraws{pending_phases, offset});
  }

  template <typename Draws>
  [[gnu::always_inline]] void encode_pending(int64_t offset, int64_t n, Draws draws) {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_values != nullptr) {
        encode_codes<kSigned>(pending_values + offset, n, pending_scale, pending_codes + offset,
                              stochastic_code_rounding_of<S>(draws));
      }
    }
  }
};

// [note: shared state draws] Takes back a group of the two states that share one draw per element
// (same key, the low and the high share): the group's draws are made once, for the state that
// rounds now: a bf16 one as the group comes back, an int8 one as the block before is encoded.
template <StateCodec C, bool kLowSigned, bool kHighSigned>
[[gnu::always_inline]] inline void unstage_state_pair(StateBlock<C, kLowSigned, DrawShare::kLow>& low,
                                                      StateBlock<C, kHighSigned, DrawShare::kHigh>& high,
                                                      int64_t offset, int64_t n, uint32_t* draw_tile) {
  if constexpr (C == StateCodec::kBFloat16) {
    fill_draws(PhasedDraws{low.phases, offset}, n, draw_tile);
    low.unstage(offset, n, TiledDraws{draw_tile});
    high.unstage(offset, n, TiledDraws{draw_tile});
  } else if constexpr (C == StateCodec::kInt8) {
    low.unstage(offset, n);
    high.unstage(offset, n);
    if (low.pending_values != nullptr) {
      fill_draws(PhasedDraws{low.pending_phases, offset}, n, draw_tile);
      low.encode_pending(offset, n, TiledDraws{draw_tile});
      high.encode_pending(offset, n, TiledDraws{draw_tile});
    }
  }
}

// The chunk-long part of a staged state: the tiles of the current and the pending block, and
// where the pending block's codes go. `key`: the chunk's dither key for this state
// (ChunkKeys::dither_key with its RoundingStream) and `rotation` the step's ([note: dithered
// draws], [note: unbiased state rounding]); S: its share of each draw ([note: shared state draws]).
template <StateCodec C, bool kSigned, DrawShare S = DrawShare::kWhole>
class StagedState {
 public:
  StagedState(void* state, uint16_t* scales, uint32_t key, uint32_t rotation)
      : state_(state), scales_(scales), key_(key), rotation_(rotation) {}

  // The block of n elements from block_first.
  [[gnu::always_inline]] StateBlock<C, kSigned, S> begin_block(int64_t block_first, int64_t n) {
    StateBlock<C, kSigned, S> block{};
    if constexpr (C == StateCodec::kFloat32) {
      block.state = static_cast<float*>(state_) + block_first;
      block.values = static_cast<float*>(block.state);
    } else if constexpr (C == StateCodec::kBFloat16) {
      block.state = static_cast<uint16_t*>(state_) + block_first;
      block.values = tiles_[0];
      fill_block_phases(key_, block_first, rotation_, phases_[0]);
      block.phases = phases_[0];
    } else {
      block.state = static_cast<uint8_t*>(state_) + block_first;
      block.values = tiles_[current_];
      block.decode = block_decode_of<kSigned>(static_cast<const uint8_t*>(block.state),
                                              scales_[block_first / kCodecBlock], n);
      if (pending_n_ != 0) {
        block.pending_values = tiles_[current_ ^ 1];
        block.pending_codes = static_cast<uint8_t*>(state_) + pending_first_;
        block.pending_phases = phases_[current_ ^ 1];
        block.pending_scale = pending_scale_;
      }
    }
    return block;
  }

  // Ends `block`, of n values from block_first: the pending block's codes past n are written
  // (this block is a chunk's short last one), and this block, its scale (and form) stored,
  // becomes the pending one.
  [[gnu::always_inline]] void end_block(const StateBlock<C, kSigned, S>& block, int64_t block_first,
                                        int64_t n) {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_n_ > n) {
        const DitheredDraws draws{key_, pending_first_ + n, rotation_};
        encode_codes<kSigned>(block.pending_values + n, pending_n_ - n, pending_scale_, block.pending_codes + n,
                              stochastic_code_rounding_of<S>(draws));
      }
      pending_scale_ = block_scale_of<kSigned>(block.values, n, block.stats, block.decode.stored);
      scales_[block_first / kCodecBlock] = pending_scale_.stored;
      fill_block_phases(key_, block_first, rotation_, phases_[current_]);
      pending_first_ = block_first;
      pending_n_ = n;
      current_ ^= 1;
    }
  }

  // Writes the codes of the chunk's last block.
  [[gnu::always_inline]] void finish() {
    if constexpr (C == StateCodec::kInt8) {
      if (pending_n_ != 0) {
        uint8_t* const codes = static_cast<uint8_t*>(state_) + pending_first_;
        encode_codes<kSigned>(tiles_[current_ ^ 1], pending_n_, pending_scale_, codes,
                              stochastic_code_rounding_of<S>(PhasedDraws{phases_[current_ ^ 1], 0}));
      }
      pending_n_ = 0;
    }
  }

 private:
  static constexpr int64_t kTile = C == StateCodec::kFloat32 ? 1 : kCodecBlock;
  void* state_;
  uint16_t* scales_;
  uint32_t key_;
  uint32_t rotation_;
  static constexpr int64_t kPhases = C == StateCodec::kFloat32 ? 1 : kBlockPhases;
  alignas(64) float tiles_[2][kTile];  // the current block's values and the pending block's
  alignas(64) uint32_t phases_[2][kPhases];  // their draws ([note: block phases]); bf16: [0]
  int current_ = 0;
  int64_t pending_first_ = 0;
  int64_t pending_n_ = 0;  // 0: no block pending
  BlockScale pending_scale_{};
};

#if FUSEDAMP_F16C_LANES
// The bf16 bits (in the low half of each lane) of fp32 values rounded with `random`; a lane with
// a non-finite value takes float_to_bf16's result, which for an inf is its high half and for a
// NaN that half made quiet (| 0x40).
[[gnu::always_inline]] inline CodeLanes bf16_stochastic_lanes(CodeLanes bits, CodeLanes random) {
  CodeLanes result = shift_right(add_lanes(bits, and_lanes(random, lanes_of(0xffffu))), 16);
  const LaneMask non_finite = lanes_at_least(and_lanes(bits, lanes_of(0x7fffffffu)), 0x7f800000u);
  if (any_lane(non_finite)) {
    const CodeLanes high = shift_right(bits, 16);
    const LaneMask nan = both(non_finite, lanes_nonzero(and_lanes(bits, lanes_of(0x007fffffu))));
    result = select_lanes(non_finite, select_lanes(nan, or_masked(high, lanes_of(0x40u), 0x40u), high), result);
  }
  return result;
}
#endif

// fp32 values to fp16/bf16 params, rounded stochastically with the bits of elements
// [first_element, first_element + n) under `key` (math/stochastic.h); bf16 a vector at a time.
template <DType P>
[[gnu::always_inline]] inline void float_tile_to_half_stochastic(const float* src, uint16_t* dst, int64_t n,
                                                                 uint32_t key, int64_t first_element) {
  int64_t i = 0;
#if FUSEDAMP_F16C_LANES
  if constexpr (P == DType::kBFloat16) {
    const CodeLanes lane_index = lane_indices();
    for (; i + kCodeLanes <= n; i += kCodeLanes) {
      const CodeLanes elements = add_lanes(lanes_of(uint32_t(first_element + i)), lane_index);
      store_half_lanes(dst + i, bf16_stochastic_lanes(load_bit_lanes(src + i), rounding_bit_lanes(key, elements)));
    }
  }
#endif
  for (; i < n; ++i) {
    dst[i] = float_to_half_stochastic<P>(src[i], rounding_bits(key, first_element + i));
  }
}

// The fp32 values an optimizer updates for a range of a param: the param itself (fp32), its fp32
// master (reseeded where the param was edited, [note: edited params]), or `tile` (a half param,
// joined with its remainder when it has one).
template <DType P, MasterKind M>
[[gnu::always_inline]] inline float* stage_value_block(void* param, void* master, int64_t begin,
                                                       int64_t n, float* tile) {
  if constexpr (P == DType::kFloat32) {
    return static_cast<float*>(param) + begin;
  } else if constexpr (M == MasterKind::kFloat32) {
    reseed_edited_masters<P>(static_cast<const uint16_t*>(param) + begin, static_cast<float*>(master) + begin, n);
    return static_cast<float*>(master) + begin;
  } else if constexpr (M == MasterKind::kRemainder) {
    remainder_tile_to_float(static_cast<const uint16_t*>(param) + begin,
                            static_cast<const int16_t*>(master) + begin, tile, n);
  } else {
    half_tile_to_float<P>(static_cast<const uint16_t*>(param) + begin, tile, n);
  }
  return tile;
}

// Writes a range's updated values back: nothing for fp32 params; the half param rounded from its
// fp32 master, split with its remainder, or rounded to nearest or
// stochastically (rounding_key set) when it has no master.
template <DType P, MasterKind M>
[[gnu::always_inline]] inline void unstage_value_block(void* param, void* master, int64_t begin,
                                                       int64_t n, const float* value, bool stochastic,
                                                       uint32_t rounding_key) {
  if constexpr (P != DType::kFloat32) {
    uint16_t* half = static_cast<uint16_t*>(param) + begin;
    if constexpr (M == MasterKind::kRemainder) {
      float_tile_to_remainder(value, half, static_cast<int16_t*>(master) + begin, n);
    } else if constexpr (M == MasterKind::kFloat32) {
      float_tile_to_half<P>(value, half, n);
    } else if (stochastic) {
      float_tile_to_half_stochastic<P>(value, half, n, rounding_key, begin);
    } else {
      float_tile_to_half<P>(value, half, n);
    }
  }
}

// A range of grads as fp32: the grads themselves (fp32) or `tile`; written back by
// unstage_grad_block when the step writes the grads it used.
template <DType G>
[[gnu::always_inline]] inline float* stage_grad_block(void* grad, int64_t begin, int64_t n, float* tile) {
  if constexpr (G == DType::kFloat32) {
    return static_cast<float*>(grad) + begin;
  } else {
    half_tile_to_float<G>(static_cast<const uint16_t*>(grad) + begin, tile, n);
    return tile;
  }
}

template <DType G>
[[gnu::always_inline]] inline void unstage_grad_block(void* grad, int64_t begin, int64_t n, const float* tile,
                                                      bool write_grad) {
  if constexpr (G != DType::kFloat32) {
    if (write_grad) float_tile_to_half<G>(tile, static_cast<uint16_t*>(grad) + begin, n);
  }
}

// [note: block prefetch] The coded steps do more work per byte than the fp32 ones, and between
// blocks the hardware prefetchers fell behind: the int8 AdamW step read memory at half the fp32
// step's rate. So each block first asks for the lines of the block prefetch_distance() ahead in
// every stream the step reads (for writing: each is stored back). One or two blocks ahead were
// the fastest; farther, the lines wait in the fill buffers. The plain fp32 steps run their
// element loop a block at a time behind the same prefetches (without them the fp32 SGD step fell
// behind torch's fused one), and the half-param steps stage their groups inside the same
// prefetched blocks. On AMD's Zen 4 the same prefetches slowed every step instead, fp32 and
// coded, at one thread and at two (its hardware prefetchers keep up, and the software ones only
// add work): the distance, in blocks, is prefetch_blocks (cpu/isa.h), chosen per CPU vendor, 0
// for none.
[[gnu::always_inline]] inline int64_t prefetch_distance() {
  return prefetch_blocks.load(std::memory_order_relaxed) * kCodecBlock;
}

template <typename T>
[[gnu::always_inline]] inline void prefetch_block(const void* base, int64_t first, int64_t end) {
  const char* bytes = static_cast<const char*>(base);
  const int64_t stop = std::min(end, first + kCodecBlock) * int64_t(sizeof(T));
  for (int64_t offset = first * int64_t(sizeof(T)); offset < stop; offset += 64) {
    __builtin_prefetch(bytes + offset, 1);
  }
}

// The param (and its master), the grad and `states` of the block prefetch_distance() ahead of
// `first`, if [first, end) has one and the distance is not 0.
template <DType P, DType G, MasterKind M, StateCodec C, typename... States>
[[gnu::always_inline]] inline void prefetch_ahead(int64_t first, int64_t end, const void* param,
                                                  const void* master, const void* grad, States... states) {
  const int64_t distance = prefetch_distance();
  const int64_t ahead = first + distance;
  if (distance == 0 || ahead >= end) return;
  using Code = std::conditional_t<C == StateCodec::kInt8, uint8_t,
                                  std::conditional_t<C == StateCodec::kBFloat16, uint16_t, float>>;
  prefetch_block<storage_t<P>>(param, ahead, end);
  if constexpr (M != MasterKind::kNone) prefetch_block<master_storage_t<M>>(master, ahead, end);
  prefetch_block<storage_t<G>>(grad, ahead, end);
  (prefetch_block<Code>(states, ahead, end), ...);
}

// Calls block(begin, n) for the codec blocks of [begin, end) (begin a multiple of kCodecBlock).
template <typename Block>
[[gnu::always_inline]] inline void for_each_codec_block(int64_t begin, int64_t end, Block&& block) {
  for (int64_t first = begin; first < end; first += kCodecBlock) {
    block(first, end - first < kCodecBlock ? end - first : kCodecBlock);
  }
}

}  // namespace FUSEDAMP_ISA
}  // namespace fusedamp::cpu

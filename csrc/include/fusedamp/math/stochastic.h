// Stochastic rounding of fp32 values into bf16/fp16 params, with random bits from a counter-based
// hash of (seed, step, param, element): the same bits on CPU and CUDA, any thread count or
// chunking, and a resumed run continues bitwise without any saved RNG state.
#pragma once

#include <math.h>

#include "fusedamp/math/dtypes.h"

namespace fusedamp {

// What an optimizer call needs for its random bits: the seed, and whether the params take their
// update stochastically rounded (enabled; false: to nearest). Coded states always are.
// [note: rounding ids] Each param's id (its index in the optimizer) travels as the value of a
// pointer list of the call's TensorLists, so that the CUDA launch metadata carries it per slot.
struct StochasticRounding {
  bool enabled = false;
  uint64_t seed = 0;
};

inline void* rounding_id_as_pointer(int64_t id) { return reinterpret_cast<void*>(uintptr_t(id)); }

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

FUSEDAMP_HOST_DEVICE uint64_t rounding_id_of(const void* pointer) { return uint64_t(uintptr_t(pointer)); }

// splitmix64's finalizer: a bijection of 64-bit words with full avalanche.
FUSEDAMP_HOST_DEVICE uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The key of elements [2^32 h, 2^32 (h + 1)) of param `param_id` at step `step` (the count after
// this step), h = element >> 32: computed once per chunk (chunks never straddle 2^32).
FUSEDAMP_HOST_DEVICE uint32_t rounding_key(uint64_t seed, uint64_t param_id, uint64_t step,
                                           uint64_t element_high) {
  uint64_t x = mix64(seed + 0x9e3779b97f4a7c15ull);
  x = mix64(x ^ param_id);
  x = mix64(x ^ step);
  return uint32_t(mix64(x ^ element_high));
}

// The random streams of one step: the param's rounding and one per draw of the call's coded
// states ([note: unbiased state rounding], [note: shared state draws] in math/codec.h), so that no
// two roundings share bits unless they split them.
enum class RoundingStream : uint64_t { kParam = 0, kState0 = 1, kState1 = 2 };

// The seed of one stream of a call: the call's seed, told apart per stream.
FUSEDAMP_HOST_DEVICE uint64_t stream_seed(uint64_t seed, RoundingStream stream) {
  return seed ^ (uint64_t(stream) * 0xd1b54a32d192ed03ull);
}

// The key of a chunk that starts at element `begin` of the param whose id travels in
// `rounding_id` ([note: rounding ids]), for the step after `step` (the count before it) and
// `stream`: what both backends compute once per chunk and stream. The count is the optimizers'
// fp32 step, exact up to 2^24 steps; past that torch's float step count stops growing, and the
// keys repeat from step to step with it.
FUSEDAMP_HOST_DEVICE uint32_t chunk_rounding_key(uint64_t seed, const void* rounding_id, float step, int64_t begin,
                                                 RoundingStream stream = RoundingStream::kParam) {
  return rounding_key(stream_seed(seed, stream), rounding_id_of(rounding_id), uint64_t(step) + 1,
                      uint64_t(begin) >> 32);
}

// [note: dithered draws] A stream can take its draws dithered instead of independent from step to
// step: each element keeps one random phase (the keyed hash under a key without the step; step 0
// is no step's count) and each step adds the same rotation, step * 2^32 / golden ratio (mod 2^32),
// to every phase. A draw is still uniform over the phases, so each rounding stays unbiased, but an
// element's draws now spread evenly over the steps (the golden ratio's multiples are the most
// evenly spread), so the rounding errors of a slowly changing value cancel over a few steps
// instead of adding up as a random walk. Every coded state takes them: a param sums its updates,
// so moments whose roundings cancel over the steps leave it closer to the fp32 run than
// independent draws do, and Muon's step orthogonalizes its buffer, where the noise that adds up in
// a slow buffer (momentum 0.99) with independent draws took a few percent off the step. The codes'
// grid must hold still for this ([note: steady scales] in math/codec.h).
FUSEDAMP_HOST_DEVICE uint32_t chunk_dither_key(uint64_t seed, const void* rounding_id, int64_t begin,
                                               RoundingStream stream) {
  return rounding_key(stream_seed(seed, stream), rounding_id_of(rounding_id), 0, uint64_t(begin) >> 32);
}

// What a dithered stream adds to each phase at the step after `step` (the count before it).
FUSEDAMP_HOST_DEVICE uint32_t dither_rotation(float step) { return uint32_t(uint64_t(step) + 1) * 0x9e3779b9u; }

// What the keys of one chunk of an optimizer step are made of (chunk_rounding_key), as both
// backends gather them once per chunk: key(stream) for the param and each coded state.
struct ChunkKeys {
  uint64_t seed;
  const void* rounding_id;  // the param's ([note: rounding ids])
  float step;               // its step count before this step
  int64_t begin;            // the chunk's first element

  FUSEDAMP_HOST_DEVICE uint32_t key(RoundingStream stream) const {
    return chunk_rounding_key(seed, rounding_id, step, begin, stream);
  }

  // A dithered stream's key and this step's rotation ([note: dithered draws]).
  FUSEDAMP_HOST_DEVICE uint32_t dither_key(RoundingStream stream) const {
    return chunk_dither_key(seed, rounding_id, begin, stream);
  }
  FUSEDAMP_HOST_DEVICE uint32_t rotation() const { return dither_rotation(step); }
};

// 32 random bits of one element: Wellons' lowbias32 of its low 32 index bits and the key (two
// multiplies, vectorizable).
FUSEDAMP_HOST_DEVICE uint32_t rounding_bits(uint32_t key, int64_t element) {
  uint32_t x = uint32_t(element) ^ key;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// [note: dither phases] A phase only has to tell elements apart, so the keyed hash is taken once
// per group of kDitherGroup elements (aligned), and each element of a group adds its place in the
// group times kDitherLaneStep: a vector of codes takes one scalar hash and one vector add where a
// hash per element took two vector multiplies and six shifts and xors, in the busiest loop of the
// coded steps. The elements of a group spread their phases evenly, and kDitherLaneStep was chosen
// so that a lane's offset is far from every rotation of the next 32 steps in both halves of a draw
// (the low 12 bits and the high 20 that two states sharing it take): no element's draws repeat a
// neighbour's a few steps later. Groups at any distance, powers of two included, hash apart.
constexpr int64_t kDitherGroup = 16;
constexpr uint32_t kDitherLaneStep = 0x179030dbu;

// The hash every element of element's group of kDitherGroup starts from.
FUSEDAMP_HOST_DEVICE uint32_t dither_group_bits(uint32_t key, int64_t element) {
  return rounding_bits(key, int64_t(uint64_t(element) / uint64_t(kDitherGroup)));
}

// What the element at `place` (0 to kDitherGroup - 1) of a group adds to the group's hash.
FUSEDAMP_HOST_DEVICE uint32_t dither_lane_offset(uint32_t place) { return place * kDitherLaneStep; }

// The phase of `element` in a dithered stream under `key` (the stream's dither key).
FUSEDAMP_HOST_DEVICE uint32_t dither_phase(uint32_t key, int64_t element) {
  return dither_group_bits(key, element) + dither_lane_offset(uint32_t(uint64_t(element) % uint64_t(kDitherGroup)));
}

// value rounded to a bf16 neighbour, up with probability (distance to the lower one) / ulp: the
// random low 16 bits added to the magnitude's dropped bits carry into the kept ones. Non-finite
// values round as float_to_bf16 does.
FUSEDAMP_HOST_DEVICE uint16_t float_to_bf16_stochastic(float value, uint32_t random) {
  const uint32_t bits = float_bits(value);
  const uint32_t rounded = (bits + (random & 0xffffu)) >> 16;
  return uint16_t(select_bits(is_non_finite(value), float_to_bf16(value), rounded));
}

// The same for fp16: in fp16's normal range the 13 dropped mantissa bits take the random carry
// (the result is an exact fp16 value, converted exactly); below it the grid is 2^-24 everywhere,
// so the value in units of 2^-24 gets a random fraction added and is truncated.
FUSEDAMP_HOST_DEVICE uint16_t float_to_fp16_stochastic(float value, uint32_t random) {
  const uint32_t bits = float_bits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  const float normal = float_from_bits((bits + (random & 0x1fffu)) & ~0x1fffu);
  const float units = float_from_bits(magnitude) * 0x1.0p24f + float(random >> 8) * 0x1.0p-24f;
  const float subnormal = float_from_bits((bits & 0x80000000u) | float_bits(truncf(units) * 0x1.0p-24f));
  const bool is_subnormal = magnitude < 0x38800000u;  // below 2^-14
  const float chosen = select_float(is_subnormal, subnormal, normal);
  return float_to_fp16(select_float(is_non_finite(value), value, chosen));
}

template <DType T>
FUSEDAMP_HOST_DEVICE uint16_t float_to_half_stochastic(float value, uint32_t random) {
  if constexpr (T == DType::kFloat16) {
    return float_to_fp16_stochastic(value, random);
  } else {
    static_assert(T == DType::kBFloat16, "stochastic rounding: bf16 or fp16 only");
    return float_to_bf16_stochastic(value, random);
  }
}

FUSEDAMP_NAMESPACE_END

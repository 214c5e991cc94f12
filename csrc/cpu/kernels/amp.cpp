// CPU kernels of unscale_, check_and_norm_ and update_scale_ (built once per ISA, see setup.py):
// per-chunk loops over math/unscale.h, and the drivers that run them.
#include "ops/amp.h"

#include "cpu/blocks.h"
#include "cpu/staging.h"
#include "fusedamp/dispatch.h"
#include "fusedamp/math/unscale.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

// Half grads go through fp32 one vector at a time ([note: half staging]), with one flag per
// lane: the groups set them lane by lane, and the lanes are combined once at the end. Each
// codec block first prefetches the one prefetch_distance() ahead ([note: block prefetch]):
// without it, the unscale of bf16 grads on the AVX2 build fell behind torch's.
template <DType G>
bool unscale_range(void* grad, int64_t begin, int64_t end, float inv_scale) {
  int32_t found[kStageLanes] = {};
  const int64_t distance = prefetch_distance();
  for_each_codec_block(begin, end, [&](int64_t block, int64_t count) {
    if (distance != 0) prefetch_block<storage_t<G>>(grad, block + distance, end);
    if constexpr (G != staged<G>) {
      auto* halves = static_cast<uint16_t*>(grad);
      for_each_stage_group(block, block + count, [&](int64_t first, auto n) {
        float lanes[kStageLanes];
        half_tile_to_float<G>(halves + first, lanes, n);
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          found[j] |= int32_t(unscale_element<DType::kFloat32>(lanes, j, inv_scale));
        }
        float_tile_to_half<G>(lanes, halves + first, n);
      });
    } else {
      auto* typed = static_cast<storage_t<G>*>(grad);
      int32_t any = 0;
#pragma omp simd reduction(| : any)
      for (int64_t i = block; i < block + count; ++i) any |= int32_t(unscale_element<G>(typed, i, inv_scale));
      found[0] |= any;
    }
  });
  bool any = false;
  for (const int32_t flag : found) any |= flag != 0;
  return any;
}

// The read-only check keeps its sums of squares in kSumLanes lanes: four vectors on AVX-512 and
// eight on AVX2 take turns, where one accumulator made each add wait for the one before it (the
// check ran at about half its in-cache read speed). Half grads go through fp32 as in unscale_range.
constexpr int64_t kSumLanes = 64;

template <DType G>
GradCheck check_range(const void* grad, int64_t begin, int64_t end, float multiplier) {
  int32_t found[kSumLanes] = {};
  float sums[kSumLanes] = {};
  for_each_stage_group<kSumLanes>(begin, end, [&](int64_t first, auto n) {
    if constexpr (G != staged_read<G>) {
      float lanes[kSumLanes];
      half_tile_to_float<G>(static_cast<const uint16_t*>(grad) + first, lanes, n);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        found[j] |= int32_t(check_element<DType::kFloat32>(lanes, j, multiplier, sums[j]));
      }
    } else {
      const auto* typed = static_cast<const storage_t<G>*>(grad) + first;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) found[j] |= int32_t(check_element<G>(typed, j, multiplier, sums[j]));
    }
  });
  GradCheck result;
  for (int64_t j = 0; j < kSumLanes; ++j) {
    result.sum_of_squares += sums[j];
    result.found_non_finite |= found[j] != 0;
  }
  return result;
}

bool unscale_chunk(const UnscaleCall& call, int64_t tensor, int64_t begin, int64_t end) {
  bool found = false;
  with_float_dtype(call.dtypes[tensor], [&](auto g) {
    found = unscale_range<g.value>(call.grads.pointers[0][tensor], begin, end, *call.inv_scale);
  });
  return found;
}

GradCheck check_chunk(const CheckAndNormCall& call, int64_t tensor, int64_t begin, int64_t end) {
  GradCheck result;
  const float multiplier = call.inv_scale ? *call.inv_scale : 1.0f;
  with_float_dtype(call.dtypes[tensor], [&](auto g) {
    result = check_range<g.value>(call.grads.pointers[0][tensor], begin, end, multiplier);
  });
  return result;
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(UnscaleCall, unscale_chunk);
FUSEDAMP_REGISTER_CPU_CHUNK(CheckAndNormCall, check_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

void unscale_cpu(const UnscaleCall& call) {
  const UnscaleCall::CpuChunk chunk = cpu_chunk<UnscaleCall>();
  std::atomic<bool> found{false};
  for_each_chunk(call.grads.numels, [&](int64_t tensor, int64_t begin, int64_t end) {
    if (chunk(call, tensor, begin, end)) found.store(true);
  });
  if (found.load()) *call.found_inf = 1.0f;
}

// Sums in double, per tensor in chunk order and then over the tensors: the result does not
// depend on the thread count.
struct TensorCheck {
  double sum_of_squares = 0.0;
  bool found_non_finite = false;
};

void check_and_norm_cpu(const CheckAndNormCall& call) {
  const CheckAndNormCall::CpuChunk chunk = cpu_chunk<CheckAndNormCall>();
  const std::vector<TensorCheck> per_tensor = reduce_per_tensor(
      call.grads.numels, TensorCheck{},
      [&](int64_t tensor, int64_t begin, int64_t end) {
        const GradCheck part = chunk(call, tensor, begin, end);
        return TensorCheck{double(part.sum_of_squares), part.found_non_finite};
      },
      [](TensorCheck& into, const TensorCheck& part) {
        into.sum_of_squares += part.sum_of_squares;
        into.found_non_finite |= part.found_non_finite;
      });
  double total = 0.0;
  bool found = false;
  for (const TensorCheck& tensor : per_tensor) {
    total += tensor.sum_of_squares;
    found |= tensor.found_non_finite;
  }
  if (found) *call.found_inf = 1.0f;
  if (call.sum_of_squares) *call.sum_of_squares += float(total);
}

void update_scale_cpu(const UpdateScaleCall& call) {
  update_loss_scale(*call.scale, *call.growth_tracker, *call.hysteresis_tracker, *call.found_inf,
                    call.config);
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, UnscaleCall, unscale_cpu);
FUSEDAMP_REGISTER_KERNEL(CPU, CheckAndNormCall, check_and_norm_cpu);
FUSEDAMP_REGISTER_KERNEL(CPU, UpdateScaleCall, update_scale_cpu);
#endif

}  // namespace fusedamp::cpu

// Turns runtime element types and flags into compile-time template arguments (host code only).
#pragma once

#include <stdint.h>

#include <type_traits>

#include "fusedamp/math/codec.h"
#include "fusedamp/math/master.h"

namespace fusedamp {

// The error of a dispatch that found no kernel (param_dtype -1: not part of the message). Defined
// once, in csrc/common/dispatch.cpp: formatting a message inline here would instantiate c10's
// string templates in every CPU ISA build, and the linker keeps one copy of those for all builds
// (an AVX-512 one may then run in the baseline build).
[[noreturn]] void fail_no_kernel(const char* what, int32_t value, int32_t param_dtype = -1);

}  // namespace fusedamp

FUSEDAMP_NAMESPACE_BEGIN

template <DType T> using DTypeTag = std::integral_constant<DType, T>;
template <MasterKind M> using MasterTag = std::integral_constant<MasterKind, M>;

// The (param, grad) element types an optimizer step has kernels for: grads of the params' type or
// float32, and any grads for float32 params. The others (fp16 params with bf16 grads, which torch
// refuses by default) check_optimizer_lists refuses, and the optimizers step through an fp32 copy.
constexpr bool steps_grad_type(DType param, DType grad) {
  return param == grad || param == DType::kFloat32 || grad == DType::kFloat32;
}
template <DType P, DType G>
constexpr bool kSteppedGradType = steps_grad_type(P, G);

// Calls fn(DTypeTag<d>{}) for the float element types. csrc/common/inputs.cpp rejects every
// other type first, so reaching the error is a bug in fusedamp; it must never mean a silently
// skipped kernel.
template <typename Fn>
inline void with_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(DTypeTag<DType::kFloat32>{}); return;
    case DType::kFloat16: fn(DTypeTag<DType::kFloat16>{}); return;
    case DType::kBFloat16: fn(DTypeTag<DType::kBFloat16>{}); return;
    default: break;
  }
  fail_no_kernel("element type", int32_t(dtype));
}

// Calls fn(MasterTag<kind>{}) for the combinations that exist: fp32 params have no master,
// fp16 params a full fp32 one, bf16 params either kind. Any other combination is an error.
template <DType P, typename Fn>
inline void with_master_kind(MasterKind kind, Fn&& fn) {
  if (kind == MasterKind::kNone) {
    fn(MasterTag<MasterKind::kNone>{});
    return;
  }
  if constexpr (P != DType::kFloat32) {
    if (kind == MasterKind::kFloat32) {
      fn(MasterTag<MasterKind::kFloat32>{});
      return;
    }
  }
  if constexpr (P == DType::kBFloat16) {
    if (kind == MasterKind::kRemainder) {
      fn(MasterTag<MasterKind::kRemainder>{});
      return;
    }
  }
  fail_no_kernel("master kind", int32_t(kind), int32_t(P));
}

// Calls fn(std::integral_constant<StateCodec, codec>{}) for a call's state codec.
template <typename Fn>
inline void with_state_codec(StateCodec codec, Fn&& fn) {
  switch (codec) {
    case StateCodec::kFloat32: fn(std::integral_constant<StateCodec, StateCodec::kFloat32>{}); return;
    case StateCodec::kBFloat16: fn(std::integral_constant<StateCodec, StateCodec::kBFloat16>{}); return;
    case StateCodec::kInt8: fn(std::integral_constant<StateCodec, StateCodec::kInt8>{}); return;
  }
  fail_no_kernel("state codec", int32_t(codec));
}

template <typename Fn>
inline void with_bool(bool value, Fn&& fn) {
  if (value) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// fn(std::bool_constant<values[0]>{}, ..., std::bool_constant<values[N - 1]>{}): with_bool for
// each of the flags (`tags`: those already turned into tags).
template <size_t N, typename Fn, typename... Tags>
inline void with_bools(const bool (&values)[N], Fn&& fn, Tags... tags) {
  if constexpr (sizeof...(Tags) == N) {
    fn(tags...);
  } else {
    with_bool(values[sizeof...(Tags)], [&](auto tag) { with_bools(values, fn, tags..., tag); });
  }
}

FUSEDAMP_NAMESPACE_END

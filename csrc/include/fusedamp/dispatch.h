// Turns runtime element types and flags into compile-time template arguments (host code only).
#pragma once

#include <type_traits>

#include "fusedamp/math/master.h"

FUSEDAMP_NAMESPACE_BEGIN

template <DType T> using DTypeTag = std::integral_constant<DType, T>;
template <MasterKind M> using MasterTag = std::integral_constant<MasterKind, M>;

// Calls fn(DTypeTag<d>{}) for the float element types; other types never reach a kernel
// (csrc/common/inputs.cpp rejects them), so they are ignored here.
template <typename Fn>
inline void with_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(DTypeTag<DType::kFloat32>{}); break;
    case DType::kFloat16: fn(DTypeTag<DType::kFloat16>{}); break;
    case DType::kBFloat16: fn(DTypeTag<DType::kBFloat16>{}); break;
    default: break;
  }
}

// Calls fn(MasterTag<kind>{}) only for the combinations that exist: fp32 params have no
// master, fp16 params a full fp32 one, bf16 params either kind.
template <DType P, typename Fn>
inline void with_master_kind(MasterKind kind, Fn&& fn) {
  if (kind == MasterKind::kNone) {
    fn(MasterTag<MasterKind::kNone>{});
  } else if constexpr (P != DType::kFloat32) {
    if (kind == MasterKind::kFloat32) {
      fn(MasterTag<MasterKind::kFloat32>{});
    } else if constexpr (P == DType::kBFloat16) {
      if (kind == MasterKind::kRemainder) fn(MasterTag<MasterKind::kRemainder>{});
    }
  }
}

template <typename Fn>
inline void with_bool(bool value, Fn&& fn) {
  if (value) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

FUSEDAMP_NAMESPACE_END

// The tensors of a multi-tensor call as the kernels take them: one raw pointer per list per
// tensor, and the element count every list shares at that position.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <vector>

namespace fusedamp {

template <int kLists>
struct TensorLists {
  std::array<std::vector<void*>, kLists> pointers;  // pointers[list][tensor]; null: list unused
  std::vector<int64_t> numels;                      // numels[tensor]
};

inline std::vector<int64_t> numels_of(at::TensorList tensors) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const at::Tensor& t : tensors) numels.push_back(t.numel());
  return numels;
}

// One pointer per tensor of `tensors`, or `count` nulls for an empty (unused) list.
inline std::vector<void*> data_pointers(at::TensorList tensors, size_t count) {
  std::vector<void*> pointers(count, nullptr);
  for (size_t i = 0; i < tensors.size(); ++i) pointers[i] = tensors[i].data_ptr();
  return pointers;
}

// A float pointer to an optional one-element tensor, null when it is absent.
inline const float* optional_scalar(const c10::optional<at::Tensor>& tensor) {
  return tensor ? tensor->const_data_ptr<float>() : nullptr;
}

}  // namespace fusedamp

// Host-side shortcuts for the optimizers' cached step plan (fusedamp/optim/_plan.py): an op call
// whose tensor lists were converted once, and the check that a plan still fits its params' grads.
#pragma once

#include <ATen/core/stack.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace fusedamp {

// A torch.ops.fusedamp call whose leading tensor-list arguments are held here as C++ vectors, so
// that a call converts only its keyword scalars (the Python dispatch costs about 0.1 us for each
// tensor of a list). The list at `grads_at` (if not -1) is read at each call from the .grad of
// `grads_of`: backward makes new grad tensors every step, the plan keeps the params. It runs
// through the dispatcher as torch.ops does; the optimizer ops and check_and_norm_ unboxed, with
// the lists passed by reference (a boxed call copies each list into and out of IValues).
class PreparedCall {
 public:
  // Runs the op on these lists and the scalars (the op's later arguments, as IValues).
  using Invoke = void (*)(const c10::OperatorHandle&, const std::vector<at::TensorList>&,
                          torch::jit::Stack&);

  PreparedCall(const std::string& op, std::vector<std::vector<at::Tensor>> lists,
               std::vector<at::Tensor> grads_of, int64_t grads_at);
  void call(const py::kwargs& scalars) const;
  bool unboxed() const { return invoke_ != nullptr; }

 private:
  void bump_written(const std::vector<at::TensorList>& lists, const torch::jit::Stack& scalars) const;

  c10::OperatorHandle op_;
  std::vector<std::vector<at::Tensor>> lists_;
  std::vector<at::Tensor> grads_of_;
  int64_t grads_at_;
  Invoke invoke_;  // the unboxed call, or nullptr: boxed
};

// What a plan assumed of its params and their grads. fits() is true while every param that had a
// grad has one (any tensor: backward makes new ones) of the same dtype, layout, shape and
// contiguity, every param that had none still has none, and the params keep their dtype, device
// and contiguity (`param.data = ...` may change them).
class GradWatch {
 public:
  GradWatch(std::vector<at::Tensor> params, std::vector<c10::optional<at::Tensor>> grads);
  bool fits() const;

 private:
  struct Entry {
    at::Tensor param;
    at::ScalarType param_dtype;
    at::Device device;
    bool param_contiguous;
    bool has_grad;
    at::ScalarType grad_dtype;
    bool grad_contiguous;
  };
  std::vector<Entry> entries_;
};

// The entries of some dicts (an optimizer's state and each param's state in a plan):
// unchanged() is true while every dict holds the same keys bound to the same objects, in the
// same order. Compared by identity in C++, so a plan checks its state at a few ns an entry
// (looking a param up in optimizer.state from Python hashes it through Tensor.__hash__).
class DictWatch {
 public:
  explicit DictWatch(const std::vector<py::dict>& dicts);
  bool unchanged() const;

 private:
  struct Watched {
    py::dict dict;
    std::vector<std::pair<py::object, py::object>> entries;
  };
  std::vector<Watched> dicts_;
};

void def_prepared(py::module_& m);

}  // namespace fusedamp

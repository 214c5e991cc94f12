// PreparedCall, GradWatch and IdentityWatch, and their Python bindings (see prepared.h).
#include "python/prepared.h"

#include <ATen/core/stack.h>
#include <torch/extension.h>

#include <torch/csrc/jit/python/pybind_utils.h>

#include <tuple>
#include <type_traits>
#include <utility>

namespace fusedamp {

// A torch.ops.fusedamp call whose leading tensor-list arguments are held here as C++ vectors, so
// that a call converts only its keyword scalars (the Python dispatch costs time for each tensor
// of a list). The list at `grads_at` (if not -1) is read at each call from the .grad of
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

// The entries of some dicts (an optimizer's state and each param's state in a plan) and lists (the
// groups' params): unchanged() is true while every dict holds the same keys bound to the same
// objects in the same order, and every list the same objects. Compared by identity in C++, so a
// plan checks them at a few ns an entry (looking a param up in optimizer.state from Python
// hashes it through Tensor.__hash__). Hidden, as pybind11's own types are: it holds py::objects.
class [[gnu::visibility("hidden")]] IdentityWatch {
 public:
  IdentityWatch(const std::vector<py::dict>& dicts, const std::vector<py::list>& lists);
  bool unchanged() const;

 private:
  struct Watched {
    py::object container;
    std::vector<std::pair<py::object, py::object>> entries;  // (key, value); key None in a list
  };
  std::vector<Watched> dicts_;
  std::vector<Watched> lists_;
};


namespace {

using List = at::TensorList;
using Optional = const c10::optional<at::Tensor>&;
// The kernels' signatures (ops/*.cpp). One that no longer matches its schema's kernel makes
// typed() throw, and the call goes boxed: slower, still right.
using OptionalList = const c10::optional<at::TensorList>&;
using OptionalInts = const c10::optional<at::IntArrayRef>&;
using AdamwSignature = void(List, List, List, List, List, List, List, double, Optional, double,
                            double, double, double, bool, bool, Optional, Optional, Optional, bool,
                            OptionalList, OptionalList, OptionalList, OptionalInts, int64_t, bool);
using SgdSignature = void(List, List, List, List, List, double, Optional, double, double, double,
                          bool, bool, Optional, Optional, Optional, bool, OptionalList, OptionalInts,
                          int64_t, bool);

using MuonMomentumSignature = void(List, List, List, List, double, bool, Optional, Optional, Optional, bool,
                                   OptionalList, OptionalInts, int64_t);

// What the optional list arguments of one unboxed call point into (the stack holds IValues).
struct OwnedLists {
  OwnedLists() {
    tensors.reserve(8);
    ints.reserve(8);
  }
  std::vector<std::vector<at::Tensor>> tensors;
  std::vector<std::vector<int64_t>> ints;
};
using CheckAndNormSignature = void(List, const at::Tensor&, Optional, Optional);

template <typename Signature>
struct Unboxed;

template <typename... Args>
struct Unboxed<void(Args...)> {
  static constexpr size_t kLists = [] {
    size_t count = 0;
    for (bool is_list : {std::is_same_v<std::decay_t<Args>, List>...}) {
      if (!is_list) break;
      ++count;
    }
    return count;
  }();

  template <size_t I>
  static decltype(auto) argument(const std::vector<List>& lists, torch::jit::Stack& scalars,
                                 OwnedLists& owned) {
    using Arg = std::decay_t<std::tuple_element_t<I, std::tuple<Args...>>>;
    if constexpr (I < kLists) {
      return lists[I];
    } else if constexpr (std::is_same_v<Arg, c10::optional<at::TensorList>>) {
      const c10::IValue& value = scalars[I - kLists];
      if (value.isNone()) return c10::optional<at::TensorList>();
      owned.tensors.push_back(value.toTensorVector());
      return c10::optional<at::TensorList>(owned.tensors.back());
    } else if constexpr (std::is_same_v<Arg, c10::optional<at::IntArrayRef>>) {
      const c10::IValue& value = scalars[I - kLists];
      if (value.isNone()) return c10::optional<at::IntArrayRef>();
      owned.ints.push_back(value.toIntVector());
      return c10::optional<at::IntArrayRef>(owned.ints.back());
    } else {
      return scalars[I - kLists].to<Arg>();
    }
  }

  template <size_t... I>
  static void call(const c10::OperatorHandle& op, const std::vector<List>& lists,
                   torch::jit::Stack& scalars, std::index_sequence<I...>) {
    OwnedLists owned;
    op.typed<void(Args...)>().call(argument<I>(lists, scalars, owned)...);
  }

  static void invoke(const c10::OperatorHandle& op, const std::vector<List>& lists,
                     torch::jit::Stack& scalars) {
    call(op, lists, scalars, std::index_sequence_for<Args...>{});
  }

  // invoke, if `op` has this signature and is called with all its leading lists.
  static PreparedCall::Invoke for_op(const c10::OperatorHandle& op, size_t lists) {
    if (lists != kLists) return nullptr;
    try {
      op.typed<void(Args...)>();
    } catch (const c10::Error&) {
      return nullptr;
    }
    return &invoke;
  }
};

PreparedCall::Invoke unboxed_for(const c10::OperatorHandle& op, size_t lists) {
  const std::string& name = op.schema().name();
  if (name == "fusedamp::adamw_") return Unboxed<AdamwSignature>::for_op(op, lists);
  if (name == "fusedamp::sgd_") return Unboxed<SgdSignature>::for_op(op, lists);
  if (name == "fusedamp::muon_momentum_") return Unboxed<MuonMomentumSignature>::for_op(op, lists);
  if (name == "fusedamp::check_and_norm_") return Unboxed<CheckAndNormSignature>::for_op(op, lists);
  return nullptr;
}

}  // namespace

PreparedCall::PreparedCall(const std::string& op, std::vector<std::vector<at::Tensor>> lists,
                           std::vector<at::Tensor> grads_of, int64_t grads_at)
    : op_(c10::Dispatcher::singleton().findSchemaOrThrow(op.c_str(), "")),
      lists_(std::move(lists)),
      grads_of_(std::move(grads_of)),
      grads_at_(grads_at),
      invoke_(nullptr) {
  const auto& arguments = op_.schema().arguments();
  TORCH_CHECK_VALUE(lists_.size() <= arguments.size(), "PreparedCall: ", op, " takes ",
                    arguments.size(), " arguments, got ", lists_.size(), " lists");
  TORCH_CHECK_VALUE(grads_at >= -1 && grads_at < int64_t(lists_.size()), "PreparedCall: grads_at ",
                    grads_at, " is not one of the ", lists_.size(), " lists");
  for (size_t i = 0; i < lists_.size(); ++i) {
    TORCH_CHECK_TYPE(arguments[i].type()->kind() == c10::TypeKind::ListType, "PreparedCall: ", op,
                     " argument ", arguments[i].name(), " is not a tensor list");
  }
  if (grads_at >= 0) lists_[grads_at].clear();  // read from grads_of at each call
  invoke_ = unboxed_for(op_, lists_.size());
}

void PreparedCall::bump_written(const std::vector<at::TensorList>& lists,
                                const torch::jit::Stack& scalars) const {
  auto bump = [](const at::Tensor& tensor) {
    if (tensor.defined() && tensor.unsafeGetTensorImpl()->version_counter().enabled()) {
      tensor.unsafeGetTensorImpl()->bump_version();
    }
  };
  const auto& arguments = op_.schema().arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (i < lists.size()) {
      for (const at::Tensor& tensor : lists[i]) bump(tensor);
    } else if (scalars[i - lists.size()].isTensor()) {
      bump(scalars[i - lists.size()].toTensor());
    }
  }
}

void PreparedCall::call(const py::kwargs& scalars) const {
  const auto& arguments = op_.schema().arguments();
  std::vector<at::TensorList> lists(lists_.begin(), lists_.end());
  std::vector<at::Tensor> grads;
  if (grads_at_ >= 0) {
    grads.reserve(grads_of_.size());
    for (const at::Tensor& param : grads_of_) {
      const at::Tensor& grad = param.grad();
      TORCH_CHECK(grad.defined(), "PreparedCall: a param of the plan lost its grad (a stale plan)");
      grads.push_back(grad);
    }
    lists[grads_at_] = grads;
  }
  torch::jit::Stack stack;
  stack.reserve(arguments.size());
  size_t used = 0;
  for (size_t i = lists.size(); i < arguments.size(); ++i) {
    const c10::Argument& argument = arguments[i];
    const char* name = argument.name().c_str();
    if (scalars.contains(name)) {
      stack.push_back(torch::jit::toIValue(scalars[name], argument.type()));
      ++used;
    } else {
      TORCH_CHECK_VALUE(argument.default_value().has_value(), "PreparedCall: ",
                        op_.schema().name(), " needs the argument ", argument.name());
      stack.push_back(*argument.default_value());
    }
  }
  TORCH_CHECK_VALUE(used == scalars.size(), "PreparedCall: ", op_.schema().name(), " got ",
                    scalars.size() - used, " keyword argument(s) it does not take");
  py::gil_scoped_release no_gil;
  if (invoke_ != nullptr && !at::GradMode::is_enabled()) {
    // Below the autograd keys, whose fallbacks would box the call again only to find that no
    // grad is recorded; the one thing they do then, bump the versions of the tensors the op
    // writes, is done here.
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      invoke_(op_, lists, stack);
    }
    bump_written(lists, stack);
    return;
  }
  torch::jit::Stack boxed;
  boxed.reserve(arguments.size());
  for (const at::TensorList list : lists) boxed.emplace_back(c10::List<at::Tensor>(list.vec()));
  boxed.insert(boxed.end(), stack.begin(), stack.end());
  op_.callBoxed(boxed);
}

GradWatch::GradWatch(std::vector<at::Tensor> params, std::vector<c10::optional<at::Tensor>> grads) {
  TORCH_CHECK_VALUE(params.size() == grads.size(), "GradWatch: ", params.size(), " params but ",
                    grads.size(), " grads");
  entries_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    const bool has_grad = grads[i].has_value() && grads[i]->defined();
    entries_.push_back({param, param.scalar_type(), param.device(), param.is_contiguous(), has_grad,
                        has_grad ? grads[i]->scalar_type() : at::ScalarType::Undefined,
                        has_grad && grads[i]->is_contiguous()});
  }
}

bool GradWatch::fits() const {
  for (const Entry& entry : entries_) {
    const at::Tensor& param = entry.param;
    if (param.scalar_type() != entry.param_dtype || param.device() != entry.device ||
        param.is_contiguous() != entry.param_contiguous) {
      return false;
    }
    const at::Tensor& grad = param.grad();
    if (grad.defined() != entry.has_grad) return false;
    if (grad.defined() &&
        (grad.layout() != at::kStrided || grad.scalar_type() != entry.grad_dtype ||
         grad.device() != entry.device || grad.is_contiguous() != entry.grad_contiguous ||
         grad.sizes() != param.sizes())) {
      return false;
    }
  }
  return true;
}

IdentityWatch::IdentityWatch(const std::vector<py::dict>& dicts, const std::vector<py::list>& lists) {
  for (const py::dict& dict : dicts) {
    Watched watched{dict, {}};
    watched.entries.reserve(PyDict_Size(dict.ptr()));
    PyObject* key;
    PyObject* value;
    Py_ssize_t position = 0;
    while (PyDict_Next(dict.ptr(), &position, &key, &value)) {
      watched.entries.emplace_back(py::reinterpret_borrow<py::object>(key),
                                   py::reinterpret_borrow<py::object>(value));
    }
    dicts_.push_back(std::move(watched));
  }
  for (const py::list& list : lists) {
    Watched watched{list, {}};
    for (const py::handle item : list) {
      watched.entries.emplace_back(py::none(), py::reinterpret_borrow<py::object>(item));
    }
    lists_.push_back(std::move(watched));
  }
}

bool IdentityWatch::unchanged() const {
  for (const Watched& watched : dicts_) {
    PyObject* dict = watched.container.ptr();
    if (PyDict_Size(dict) != Py_ssize_t(watched.entries.size())) return false;
    PyObject* key;
    PyObject* value;
    Py_ssize_t position = 0;
    for (const auto& [expected_key, expected_value] : watched.entries) {
      if (!PyDict_Next(dict, &position, &key, &value) || key != expected_key.ptr() ||
          value != expected_value.ptr()) {
        return false;
      }
    }
  }
  for (const Watched& watched : lists_) {
    PyObject* list = watched.container.ptr();
    if (PyList_GET_SIZE(list) != Py_ssize_t(watched.entries.size())) return false;
    for (size_t i = 0; i < watched.entries.size(); ++i) {
      if (PyList_GET_ITEM(list, Py_ssize_t(i)) != watched.entries[i].second.ptr()) return false;
    }
  }
  return true;
}

// Whether every grad goes to the fused grad kernels as it is: strided, dense as check_dense_on
// accepts it, and float32, float16 or bfloat16. One loop in C++ instead of one in Python on the
// step's path (fusedamp/ops.py).
bool grads_fit_kernels(const std::vector<at::Tensor>& grads) {
  for (const at::Tensor& grad : grads) {
    const at::ScalarType type = grad.scalar_type();
    if (grad.layout() != at::kStrided || !(type == at::kFloat || type == at::kHalf || type == at::kBFloat16) ||
        !(grad.is_contiguous() || grad.is_non_overlapping_and_dense())) {
      return false;
    }
  }
  return true;
}

void def_prepared(py::module_& m) {
  m.def("grads_fit_kernels", &grads_fit_kernels, py::arg("grads"),
        "Whether every grad is a dense float32, float16 or bfloat16 tensor the fused grad ops take as it is.");
  py::class_<PreparedCall>(m, "PreparedCall",
                           "A fusedamp op with its leading tensor lists converted once.")
      .def(py::init<const std::string&, std::vector<std::vector<at::Tensor>>,
                    std::vector<at::Tensor>, int64_t>(),
           py::arg("op"), py::arg("lists"), py::arg("grads_of"), py::arg("grads_at"))
      .def("__call__", &PreparedCall::call, "Runs the op with these keyword arguments.")
      .def_property_readonly("unboxed", &PreparedCall::unboxed,
                             "Whether the lists go to the kernel by reference (see prepared.h).");
  py::class_<GradWatch>(m, "GradWatch", "What a step plan assumed of its params' grads.")
      .def(py::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>>(),
           py::arg("params"), py::arg("grads"))
      .def("fits", &GradWatch::fits,
           "Whether the params and grads still have the dtypes, layouts and presence seen.");
  py::class_<IdentityWatch>(m, "IdentityWatch",
                            "The entries of some dicts and lists, compared by identity.")
      .def(py::init<const std::vector<py::dict>&, const std::vector<py::list>&>(),
           py::arg("dicts"), py::arg("lists"))
      .def("unchanged", &IdentityWatch::unchanged,
           "Whether every dict and list holds the same objects (and keys), in order.");
}

}  // namespace fusedamp

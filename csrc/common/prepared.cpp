// PreparedCall and GradWatch (see prepared.h), and their Python bindings.
#include "common/prepared.h"

#include <torch/csrc/jit/python/pybind_utils.h>

namespace fusedamp {

PreparedCall::PreparedCall(const std::string& op, std::vector<std::vector<at::Tensor>> lists,
                           std::vector<at::Tensor> grads_of, int64_t grads_at)
    : op_(c10::Dispatcher::singleton().findSchemaOrThrow(op.c_str(), "")),
      grads_of_(std::move(grads_of)),
      grads_at_(grads_at) {
  const auto& arguments = op_.schema().arguments();
  TORCH_CHECK_VALUE(lists.size() <= arguments.size(), "PreparedCall: ", op, " takes ",
                    arguments.size(), " arguments, got ", lists.size(), " lists");
  TORCH_CHECK_VALUE(grads_at >= -1 && grads_at < int64_t(lists.size()), "PreparedCall: grads_at ",
                    grads_at, " is not one of the ", lists.size(), " lists");
  for (size_t i = 0; i < lists.size(); ++i) {
    TORCH_CHECK_TYPE(arguments[i].type()->kind() == c10::TypeKind::ListType, "PreparedCall: ", op,
                     " argument ", arguments[i].name(), " is not a tensor list");
    lists_.emplace_back(c10::List<at::Tensor>(std::move(lists[i])));
  }
}

void PreparedCall::call(const py::kwargs& scalars) const {
  const auto& arguments = op_.schema().arguments();
  torch::jit::Stack stack(lists_.begin(), lists_.end());
  stack.reserve(arguments.size());
  if (grads_at_ >= 0) {
    c10::List<at::Tensor> grads;
    grads.reserve(grads_of_.size());
    for (const at::Tensor& param : grads_of_) {
      const at::Tensor& grad = param.grad();
      TORCH_CHECK(grad.defined(), "PreparedCall: a param of the plan lost its grad (a stale plan)");
      grads.push_back(grad);
    }
    stack[grads_at_] = std::move(grads);
  }
  size_t used = 0;
  for (size_t i = lists_.size(); i < arguments.size(); ++i) {
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
  op_.callBoxed(stack);
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

DictWatch::DictWatch(const std::vector<py::dict>& dicts) {
  dicts_.reserve(dicts.size());
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
}

bool DictWatch::unchanged() const {
  for (const Watched& watched : dicts_) {
    PyObject* dict = watched.dict.ptr();
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
  return true;
}

void def_prepared(py::module_& m) {
  py::class_<PreparedCall>(m, "PreparedCall",
                           "A fusedamp op with its leading tensor lists converted once.")
      .def(py::init<const std::string&, std::vector<std::vector<at::Tensor>>,
                    std::vector<at::Tensor>, int64_t>(),
           py::arg("op"), py::arg("lists"), py::arg("grads_of"), py::arg("grads_at"))
      .def("__call__", &PreparedCall::call, "Runs the op with these keyword arguments.");
  py::class_<GradWatch>(m, "GradWatch", "What a step plan assumed of its params' grads.")
      .def(py::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>>(),
           py::arg("params"), py::arg("grads"))
      .def("fits", &GradWatch::fits,
           "Whether the params and grads still have the dtypes, layouts and presence seen.");
  py::class_<DictWatch>(m, "DictWatch", "The entries of some dicts, compared by identity.")
      .def(py::init<const std::vector<py::dict>&>(), py::arg("dicts"))
      .def("unchanged", &DictWatch::unchanged,
           "Whether every dict holds the same keys bound to the same objects, in order.");
}

}  // namespace fusedamp

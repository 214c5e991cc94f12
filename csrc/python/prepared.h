// The Python bindings of the optimizers' step plan in C++ (fusedamp/optim/_plan.py): an op call
// whose tensor lists were converted once, and the checks that a plan still fits (prepared.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace fusedamp {

void def_prepared(pybind11::module_& m);

}  // namespace fusedamp

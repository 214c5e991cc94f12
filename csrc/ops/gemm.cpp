// fusedamp::gemm: its arguments checked once (common/gemm.cpp) into a GemmCall for the kernel of
// the call's device. The CPU kernel is the ATen reference (fp32 accumulation, one rounding).
#include <torch/library.h>

#include "common/gemm.h"
#include "common/registry.h"

namespace fusedamp::gemm {
namespace {

std::tuple<at::Tensor, at::Tensor> gemm(const at::Tensor& a, const at::Tensor& b,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::string_view activation,
                                        c10::optional<at::ScalarType> out_dtype,
                                        bool keep_preactivation) {
  return run_kernel(check_gemm_call(a, b, bias, std::string(activation), out_dtype, keep_preactivation));
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, GemmCall, gemm_reference);
FUSEDAMP_IMPL("gemm", &gemm)

}  // namespace fusedamp::gemm

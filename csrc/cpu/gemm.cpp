// CPU backend of fusedamp::gemm: the ATen reference (fp32 accumulation, one rounding at the end).
#include <torch/library.h>

#include "common/gemm.h"

namespace fusedamp::gemm {
namespace {

std::tuple<at::Tensor, at::Tensor> gemm_cpu(const at::Tensor& a, const at::Tensor& b,
                                            const c10::optional<at::Tensor>& bias,
                                            c10::string_view activation,
                                            c10::optional<at::ScalarType> out_dtype,
                                            bool keep_preactivation) {
  const GemmCall call = check_gemm_call(a, b, bias, std::string(activation), out_dtype);
  return gemm_reference(call, b, bias, keep_preactivation);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) { m.impl("gemm", &gemm_cpu); }

}  // namespace fusedamp::gemm

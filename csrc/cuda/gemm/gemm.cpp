// CUDA backend of fusedamp::gemm: validates, picks a kernel for the device and the operands'
// layouts (wgmma on sm_90a, mma.sync on sm_80+, else the ATen reference) and launches it.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/gemm.h"
#include "cuda/gemm/params.h"

namespace fusedamp::gemm {
namespace {

// A 2-D operand as the kernels see it: one unit stride and a leading dimension.
struct Operand {
  at::Tensor tensor;
  bool unit_col_stride;  // element (r, c) at r * ld + c; otherwise at c * ld + r
  int64_t ld;
};

Operand describe(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(cols, 1)) return {t, true, t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(rows, 1)) return {t, false, t.stride(1)};
  at::Tensor dense = t.contiguous();
  return {dense, true, std::max<int64_t>(cols, 1)};
}

// What the kernels need from an operand: 16-byte aligned rows (cp.async / TMA).
bool kernel_ready(const Operand& op) {
  return op.ld % 8 == 0 && reinterpret_cast<uintptr_t>(op.tensor.data_ptr()) % 16 == 0;
}

enum class Kernel { kReference, kSm80, kSm90 };

Kernel choose_kernel(const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k,
                     bool out_fp32) {
  const Backend wanted = backend();
  if (wanted == Backend::kReference) return Kernel::kReference;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int cc = props->major * 10 + props->minor;
  const bool sm90 = cc == 90 && sm90_kernels_built();
  TORCH_CHECK(wanted != Backend::kWgmma || sm90, "fusedamp.gemm: the wgmma backend needs an sm_90 "
              "GPU and a build for arch 9.0a; this is sm_", cc, ". Use 'auto' or 'mma_sync'.");
  TORCH_CHECK(wanted != Backend::kMmaSync || cc >= 80, "fusedamp.gemm: the mma_sync backend needs "
              "an sm_80 or newer GPU; this is sm_", cc, ". Use 'reference'.");
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  if (cc < 80 || k == 0 || m > int_max || n > int_max || k > int_max || !kernel_ready(a) ||
      !kernel_ready(b)) {
    return Kernel::kReference;
  }
  // TMA stores need 16-byte output rows; fp32 outputs are left to mma.sync (see sm90.cuh).
  const bool sm90_fits = !out_fp32 && n % 8 == 0;
  if (sm90 && sm90_fits && (wanted == Backend::kAuto || wanted == Backend::kWgmma)) {
    return Kernel::kSm90;
  }
  if (wanted == Backend::kWgmma) return Kernel::kReference;
  return Kernel::kSm80;
}

std::tuple<at::Tensor, at::Tensor> gemm_cuda(const at::Tensor& a, const at::Tensor& b,
                                             const c10::optional<at::Tensor>& bias,
                                             c10::string_view activation,
                                             c10::optional<at::ScalarType> out_dtype,
                                             bool keep_preactivation) {
  const GemmCall call = check_gemm_call(a, b, bias, std::string(activation), out_dtype);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t m = call.a2d.size(0), k = call.a2d.size(1), n = b.size(1);
  const Operand a_op = describe(call.a2d);
  const Operand b_op = describe(b);
  const bool out_fp32 = call.out_dtype == at::kFloat;
  const Kernel kernel = m == 0 || n == 0 ? Kernel::kReference
                                         : choose_kernel(a_op, b_op, m, n, k, out_fp32);
  if (kernel == Kernel::kReference) return gemm_reference(call, b, bias, keep_preactivation);

  const at::TensorOptions options = a.options().dtype(call.out_dtype);
  at::Tensor out = at::empty({m, n}, options);
  at::Tensor preact = keep_preactivation ? at::empty({m, n}, options) : at::empty({0}, options);
  at::Tensor bias_dense = bias.has_value() ? bias->contiguous() : at::Tensor();

  GemmParams p;
  p.a = a_op.tensor.data_ptr();
  p.b = b_op.tensor.data_ptr();
  p.bias = bias_dense.defined() ? bias_dense.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.preact = keep_preactivation ? preact.data_ptr() : nullptr;
  p.lda = a_op.ld;
  p.ldb = b_op.ld;
  p.m = int32_t(m);
  p.n = int32_t(n);
  p.k = int32_t(k);
  p.a_k_major = a_op.unit_col_stride;   // A is (M, K): unit column stride = unit k stride
  p.b_k_major = !b_op.unit_col_stride;  // B is (K, N): unit column stride = unit n stride
  p.bias_fp32 = bias_dense.defined() && bias_dense.scalar_type() == at::kFloat;
  p.out_fp32 = out_fp32;
  p.activation = call.activation;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool fp16 = a.scalar_type() == at::kHalf;
  if (kernel == Kernel::kSm90) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    fp16 ? launch_sm90_fp16(p, sms, stream) : launch_sm90_bf16(p, sms, stream);
  } else {
    fp16 ? launch_sm80_fp16(p, stream) : launch_sm80_bf16(p, stream);
  }
  if (keep_preactivation) preact = preact.reshape(call.out_shape);
  return {out.reshape(call.out_shape), preact};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl("gemm", &gemm_cuda); }

}  // namespace fusedamp::gemm

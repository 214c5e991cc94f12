// CUDA kernel of fusedamp::gemm: picks a kernel for the device, the code this build has for it
// and the operands' layouts (wgmma on sm_90a, mma.sync on sm_80+, else the ATen reference) and
// launches it. Below sm_80 (Turing) every gemm runs the ATen reference: a build that targets 7.5
// holds the mma.sync kernels with empty bodies there (sm80.cuh), which are never launched.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <unordered_map>

#include "ops/gemm.h"
#include "common/registry.h"
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

// Which GEMM code this build holds for a device. Asked of the CUDA runtime once per device:
// kernel images do not change while the process runs.
struct DeviceCode {
  int32_t cc;
  bool mma_sync;
  bool wgmma;
};

DeviceCode device_code(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::unordered_map<c10::DeviceIndex, DeviceCode> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(device);
  if (found != known.end()) return found->second;
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  const c10::cuda::CUDAGuard guard(device);  // the image queries ask about the current device
  const DeviceCode code{props->major * 10 + props->minor, sm80_kernels_built(),
                        sm90_kernels_built()};
  known.emplace(device, code);
  return code;
}

// What the kernels need from an operand: 16-byte aligned rows (cp.async / TMA).
bool kernel_ready(const Operand& op) {
  return op.ld % 8 == 0 && reinterpret_cast<uintptr_t>(op.tensor.data_ptr()) % 16 == 0;
}

Kernel pick_kernel(Backend backend, const DeviceCode& code, const Operand& a, const Operand& b,
                   int64_t m, int64_t n, int64_t k, bool out_fp32) {
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  KernelChoiceInputs in;
  in.cc = code.cc;
  in.mma_sync_code = code.mma_sync;
  in.wgmma_code = code.wgmma;
  in.kernel_fits = k > 0 && m <= int_max && n <= int_max && k <= int_max && kernel_ready(a) &&
                   kernel_ready(b);
  // TMA stores need 16-byte output rows; fp32 outputs are left to mma.sync (see sm90.cuh).
  in.wgmma_fits = !out_fp32 && n % 8 == 0;
  const KernelChoice choice = choose_kernel(backend, in);
  if (choice.missing == MissingCode::kMmaSync) {
    TORCH_WARN_ONCE("fusedamp.gemm: this build has no mma.sync code that runs on this sm_", code.cc,
                    " GPU (fusedamp.build_info()['cuda_archs'] lists the archs it was built for), ",
                    "so gemm runs the slower ATen reference. Rebuild with TORCH_CUDA_ARCH_LIST ",
                    "naming this GPU's arch.");
  } else if (choice.missing == MissingCode::kWgmma) {
    TORCH_WARN_ONCE("fusedamp.gemm: this build has no sm_90a wgmma code (arch 9.0 without the 'a' ",
                    "compiles it empty), so gemm uses the slower mma.sync kernel. Rebuild with ",
                    "TORCH_CUDA_ARCH_LIST including 9.0a.");
  }
  return choice.kernel;
}

std::tuple<at::Tensor, at::Tensor> gemm_cuda(const GemmCall& call) {
  const c10::cuda::CUDAGuard guard(call.device);
  const at::Tensor& a = call.a2d;
  const c10::optional<at::Tensor>& bias = call.bias;
  const bool keep_preactivation = call.keep_preactivation;
  const int64_t m = a.size(0), k = a.size(1), n = call.b.size(1);
  const Backend chosen_backend = backend();
  if (m == 0 || n == 0 || chosen_backend == Backend::kReference) return gemm_reference(call);
  const Operand a_op = describe(a);
  const Operand b_op = describe(call.b);
  const bool out_fp32 = call.out_dtype == at::kFloat;
  const DeviceCode code = device_code(a.device().index());
  const Kernel kernel = pick_kernel(chosen_backend, code, a_op, b_op, m, n, k, out_fp32);
  if (kernel == Kernel::kReference) return gemm_reference(call);
  // The choice only takes a kernel whose real code runs here; an empty body (mma.sync below sm_80,
  // wgmma outside sm_90a) would leave `out` unwritten without an error.
  TORCH_INTERNAL_ASSERT(kernel == Kernel::kWgmma ? code.wgmma : code.cc >= 80 && code.mma_sync,
                        "fusedamp.gemm: chose a kernel with no code for this sm_", code.cc, " GPU");

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
  if (kernel == Kernel::kWgmma) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const Sm90Schedule schedule = sm90_schedule(chosen_backend, m, n, sms);
    fp16 ? launch_sm90_fp16(p, schedule, sms, stream) : launch_sm90_bf16(p, schedule, sms, stream);
  } else {
    fp16 ? launch_sm80_fp16(p, stream) : launch_sm80_bf16(p, stream);
  }
  if (keep_preactivation) preact = preact.reshape(call.out_shape);
  return {out.reshape(call.out_shape), preact};
}

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CUDA, GemmCall, gemm_cuda);

}  // namespace fusedamp::gemm

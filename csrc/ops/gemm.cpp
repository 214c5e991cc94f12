// fusedamp::gemm: its arguments checked once into a GemmCall for the kernel of the call's device;
// the ATen reference (fp32 accumulation, one rounding), which is the CPU kernel and the CUDA
// fallback; and the process-wide choice of CUDA GEMM kernels (see ops/gemm.h; the kernels are in
// cuda/gemm/).
#include "ops/gemm.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <atomic>
#include <iterator>

#include "common/registry.h"

namespace fusedamp::gemm {
namespace {

std::atomic<Backend> g_backend{Backend::kReference};

constexpr const char* kBackendNames[] = {
    "reference", "auto", "mma_sync", "wgmma", "wgmma_cooperative", "wgmma_pingpong"};

Activation parse_activation(const std::string& name) {
  if (name == "none") return Activation::kNone;
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  TORCH_CHECK_VALUE(false, "fusedamp.gemm: activation must be 'none', 'relu', 'gelu' or ",
                    "'gelu_tanh', got '", name, "'");
}

}  // namespace

GemmCall check_gemm_call(const at::Tensor& a, const at::Tensor& b,
                         const c10::optional<at::Tensor>& bias, const std::string& activation,
                         c10::optional<at::ScalarType> out_dtype, bool keep_preactivation) {
  const at::ScalarType dtype = a.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16,
                   "fusedamp.gemm: a must be float16 or bfloat16, got ", dtype,
                   "; cast it (e.g. under autocast) before calling gemm");
  TORCH_CHECK_TYPE(b.scalar_type() == dtype, "fusedamp.gemm: b has dtype ", b.scalar_type(),
                   " but a has ", dtype, "; cast both to the same half type");
  TORCH_CHECK(a.dim() >= 1, "fusedamp.gemm: a must have at least 1 dimension (..., K)");
  TORCH_CHECK(b.dim() == 2, "fusedamp.gemm: b must be 2-D (K, N), got shape ", b.sizes(),
              "; for x @ W.T pass W.t()");
  TORCH_CHECK(a.size(-1) == b.size(0), "fusedamp.gemm: a has shape ", a.sizes(), " and b ",
              b.sizes(), "; a's last dim must equal b's first (K)");
  TORCH_CHECK(a.device() == b.device(), "fusedamp.gemm: a is on ", a.device(), " but b on ",
              b.device(), "; move them to one device");
  TORCH_CHECK(a.layout() == at::kStrided && b.layout() == at::kStrided,
              "fusedamp.gemm: a and b must be dense (strided) tensors");
  const int64_t n = b.size(1);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "fusedamp.gemm: bias must have shape (",
                n, ",) to match b's columns, got ", bias->sizes());
    TORCH_CHECK_TYPE(bias->scalar_type() == dtype || bias->scalar_type() == at::kFloat,
                     "fusedamp.gemm: bias must be ", dtype, " or float32, got ",
                     bias->scalar_type());
    TORCH_CHECK(bias->device() == a.device(), "fusedamp.gemm: bias is on ", bias->device(),
                " but a on ", a.device());
  }
  const at::ScalarType out = out_dtype.value_or(dtype);
  TORCH_CHECK_TYPE(out == dtype || out == at::kFloat, "fusedamp.gemm: out_dtype must be ", dtype,
                   " (a's dtype) or float32, got ", out);

  GemmCall call{a.device(), {}, b, bias, out, {}, {}, keep_preactivation};
  const int64_t rows = c10::multiply_integers(a.sizes().begin(), a.sizes().end() - 1);
  call.a2d = a.reshape({rows, a.size(-1)});
  call.activation = parse_activation(activation);
  call.out_shape = a.sizes().vec();
  call.out_shape.back() = n;
  return call;
}

std::tuple<at::Tensor, at::Tensor> gemm_reference(const GemmCall& call) {
  at::Tensor z = at::mm(call.a2d.to(at::kFloat), call.b.to(at::kFloat));
  if (call.bias.has_value()) z.add_(call.bias->to(at::kFloat));
  at::Tensor activated;
  switch (call.activation) {
    case Activation::kRelu: activated = at::relu(z); break;
    case Activation::kGelu: activated = at::gelu(z, "none"); break;
    case Activation::kGeluTanh: activated = at::gelu(z, "tanh"); break;
    default: activated = z; break;
  }
  at::Tensor out = activated.to(call.out_dtype).reshape(call.out_shape);
  // A copy: with no activation and fp32 output, out may be z itself, and outputs must not alias.
  at::Tensor preact = call.keep_preactivation
                          ? z.to(call.out_dtype, /*non_blocking=*/false, /*copy=*/true)
                                .reshape(call.out_shape)
                          : at::empty({0}, out.options());
  return {out, preact};
}

Backend backend() { return g_backend.load(); }

std::string backend_name() { return kBackendNames[int32_t(backend())]; }

Backend parse_backend(const std::string& name) {
  for (int32_t i = 0; i < int32_t(std::size(kBackendNames)); ++i) {
    if (name == kBackendNames[i]) return Backend(i);
  }
  TORCH_CHECK_VALUE(false, "fusedamp: unknown gemm backend '", name,
                    "'; choose reference, auto, mma_sync, wgmma, wgmma_cooperative or ",
                    "wgmma_pingpong");
}

std::string set_backend(const std::string& name) {
  const Backend previous = g_backend.exchange(parse_backend(name));
  return kBackendNames[int32_t(previous)];
}

KernelChoice choose_kernel(Backend backend, const KernelChoiceInputs& in) {
  if (backend == Backend::kReference) return {Kernel::kReference, MissingCode::kNone};
  TORCH_CHECK(!forces_wgmma(backend) || in.wgmma_code, "fusedamp.gemm: the ",
              kBackendNames[int32_t(backend)], " backend needs an sm_90 GPU and a build for arch ",
              "9.0a (fusedamp.build_info()['gemm_kernels'] lists this build's kernels); this is ",
              "sm_", in.cc, ". Use 'auto' or 'mma_sync'.");
  TORCH_CHECK(backend != Backend::kMmaSync || in.cc >= 80, "fusedamp.gemm: the mma_sync backend ",
              "needs an sm_80 or newer GPU; this is sm_", in.cc, ". Use 'reference'.");
  TORCH_CHECK(backend != Backend::kMmaSync || in.mma_sync_code, "fusedamp.gemm: this build has ",
              "no mma.sync code that runs on this sm_", in.cc, " GPU (fusedamp.build_info()",
              "['cuda_archs'] lists the archs it was built for). Rebuild with TORCH_CUDA_ARCH_LIST ",
              "naming this GPU's arch, or use 'auto' or 'reference'.");
  if (!in.kernel_fits) return {Kernel::kReference, MissingCode::kNone};
  if (forces_wgmma(backend)) {
    return {in.wgmma_fits ? Kernel::kWgmma : Kernel::kReference, MissingCode::kNone};
  }
  if (backend == Backend::kMmaSync) return {Kernel::kMmaSync, MissingCode::kNone};
  if (in.wgmma_code && in.wgmma_fits) return {Kernel::kWgmma, MissingCode::kNone};
  if (in.cc < 80) return {Kernel::kReference, MissingCode::kNone};
  if (!in.mma_sync_code) return {Kernel::kReference, MissingCode::kMmaSync};
  const bool wgmma_missing = in.cc == 90 && !in.wgmma_code && in.wgmma_fits;
  return {Kernel::kMmaSync, wgmma_missing ? MissingCode::kWgmma : MissingCode::kNone};
}

Sm90Schedule sm90_schedule(Backend backend, int64_t m, int64_t n, int32_t sm_count) {
  if (backend == Backend::kWgmmaCooperative) return Sm90Schedule::kCooperative;
  if (backend == Backend::kWgmmaPingpong) return Sm90Schedule::kPingpong;
  return choose_sm90_schedule(m, n, sm_count);
}

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

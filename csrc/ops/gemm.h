// The call struct of gemm (GemmCall) and what the op and its kernels share (ops/gemm.cpp): the
// argument checks, the ATen reference implementation (the CPU kernel and the CUDA fallback) and
// the process-wide choice of CUDA GEMM kernels (cuda/gemm/gemm.cpp launches the chosen one).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>

#include "fusedamp/gemm/tiles.h"

namespace fusedamp::gemm {

// A validated gemm call (see registry.h): a flattened to 2-D, the other operands, the output dtype,
// the activation.
struct GemmCall {
  static constexpr const char* kOp = "gemm";
  using Result = std::tuple<at::Tensor, at::Tensor>;  // (out, preactivation or empty)
  c10::Device device;
  at::Tensor a2d;  // (M, K): a with its leading dims flattened (a view when possible)
  at::Tensor b;    // (K, N), any strides
  c10::optional<at::Tensor> bias;
  at::ScalarType out_dtype;  // a's dtype or float32
  Activation activation;
  std::vector<int64_t> out_shape;  // a.shape[:-1] + (N,)
  bool keep_preactivation;
};

GemmCall check_gemm_call(const at::Tensor& a, const at::Tensor& b,
                         const c10::optional<at::Tensor>& bias, const std::string& activation,
                         c10::optional<at::ScalarType> out_dtype, bool keep_preactivation);

// out = act(a @ b + bias) with fp32 accumulation on whatever device the tensors are on:
// the operands are upcast to fp32, multiplied by ATen, biased and activated in fp32, and the
// result (and the pre-activation, when kept) rounded once to out_dtype. Returns (out, preact),
// preact empty unless keep_preactivation.
std::tuple<at::Tensor, at::Tensor> gemm_reference(const GemmCall& call);

// Which code computes CUDA gemms. kReference (the default while the kernels trail cuBLAS)
// always uses gemm_reference; kAuto picks wgmma on sm_90, mma.sync on other sm_80+ GPUs;
// kMmaSync / kWgmma force one kernel family, and kWgmma its schedule per shape
// (choose_sm90_schedule); kWgmmaCooperative / kWgmmaPingpong force wgmma and one schedule (what
// the benchmark compares). Shapes a kernel cannot take use gemm_reference.
enum class Backend : int32_t {
  kReference = 0,
  kAuto = 1,
  kMmaSync = 2,
  kWgmma = 3,
  kWgmmaCooperative = 4,
  kWgmmaPingpong = 5,
};

Backend backend();
std::string backend_name();
// The backend called `name` (reference, auto, mma_sync, wgmma, wgmma_cooperative,
// wgmma_pingpong); a ValueError for other names.
Backend parse_backend(const std::string& name);
// Sets the backend by name; returns the previous name.
std::string set_backend(const std::string& name);

// The code that runs one CUDA gemm.
enum class Kernel : int32_t { kReference = 0, kMmaSync = 1, kWgmma = 2 };

// What the kernel choice needs to know besides the backend (host-only, so that tests reach every
// combination without a GPU, through _C.gemm_choose_kernel).
struct KernelChoiceInputs {
  int32_t cc;          // the device's compute capability, major * 10 + minor
  bool mma_sync_code;  // this build holds mma.sync code the device runs (its SASS, or PTX it JITs)
  bool wgmma_code;     // this build holds sm_90a wgmma code the device runs
  bool kernel_fits;    // the kernels take the problem: 1 <= K, sizes fit int32, aligned operands
  bool wgmma_fits;     // the wgmma kernel takes it too: 16-bit output, N a multiple of 8
};

// Why `auto` did not take the kernel made for this device: this build lacks its code.
enum class MissingCode : int32_t { kNone = 0, kMmaSync = 1, kWgmma = 2 };

struct KernelChoice {
  Kernel kernel;
  MissingCode missing;  // the caller warns once about each kind
};

// auto: wgmma where its code runs and the problem fits, else mma.sync on sm_80+ when this build
// has code for the device, else the reference. A forced mma_sync or wgmma backend is an error on a
// device the build has no such code for; a problem the forced kernel cannot take gets the
// reference.
KernelChoice choose_kernel(Backend backend, const KernelChoiceInputs& in);

// Whether `backend` runs wgmma only (one of its schedules or the per-shape choice).
inline bool forces_wgmma(Backend backend) {
  return backend == Backend::kWgmma || backend == Backend::kWgmmaCooperative ||
         backend == Backend::kWgmmaPingpong;
}

// The wgmma schedule of an (m, n) output on `sm_count` SMs: the forced one, else the per-shape
// choice.
Sm90Schedule sm90_schedule(Backend backend, int64_t m, int64_t n, int32_t sm_count);

}  // namespace fusedamp::gemm

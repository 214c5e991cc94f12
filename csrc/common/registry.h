// Which code runs an op's call struct. Backend files register their kernels for the call type
// when _C is loaded; the op's own file runs the one for the call's device. On CPU the kernel is a
// driver (built once, for any x86-64) that runs the op's chunk kernel of the active ISA build.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <type_traits>

namespace fusedamp {

// The CPU kernel builds (csrc/cpu/kernels/*.cpp are compiled once for each, see setup.py).
enum class CpuIsa : int32_t { kAvx512 = 0, kAvx2 = 1, kBaseline = 2 };
constexpr int kCpuIsaCount = 3;

// The build the CPU ops run now: the best this CPU supports, or the one chosen by
// FUSEDAMP_CPU_ISA / set_cpu_isa (csrc/cpu/isa.cpp).
CpuIsa active_cpu_isa();

// A call struct has a member `c10::Device device` and `static constexpr const char* kOp` (its
// op's name). It declares `using Result = ...` when its kernels return something, and
// `using CpuChunk = <function pointer type>` when its CPU driver runs per-ISA chunk kernels.
template <typename Call, typename = void>
struct ResultOf {
  using type = void;
};
template <typename Call>
struct ResultOf<Call, std::void_t<typename Call::Result>> {
  using type = typename Call::Result;
};
template <typename Call, typename = void>
struct CpuChunkOf {
  using type = void*;
};
template <typename Call>
struct CpuChunkOf<Call, std::void_t<typename Call::CpuChunk>> {
  using type = typename Call::CpuChunk;
};

template <typename Call>
using KernelFor = typename ResultOf<Call>::type (*)(const Call&);

template <typename Call>
struct KernelSlots {
  KernelFor<Call> cpu = nullptr;
  KernelFor<Call> cuda = nullptr;
  typename CpuChunkOf<Call>::type cpu_chunks[kCpuIsaCount] = {};
};

template <typename Call>
KernelSlots<Call>& kernel_slots() {
  static KernelSlots<Call> slots;
  return slots;
}

// Static objects of these types register a kernel when _C is loaded.
template <typename Call>
struct RegisterKernel {
  RegisterKernel(c10::DeviceType device, KernelFor<Call> kernel) {
    (device == c10::DeviceType::CUDA ? kernel_slots<Call>().cuda : kernel_slots<Call>().cpu) = kernel;
  }
};
template <typename Call>
struct RegisterCpuChunk {
  RegisterCpuChunk(CpuIsa isa, typename Call::CpuChunk chunk) {
    kernel_slots<Call>().cpu_chunks[int32_t(isa)] = chunk;
  }
};

// Runs the kernel registered for the call's device.
template <typename Call>
typename ResultOf<Call>::type run_kernel(const Call& call) {
  const KernelSlots<Call>& slots = kernel_slots<Call>();
  const KernelFor<Call> kernel = call.device.is_cuda()  ? slots.cuda
                                 : call.device.is_cpu() ? slots.cpu
                                                        : nullptr;
  TORCH_CHECK(kernel != nullptr, "fusedamp internal error: ", Call::kOp, " has no kernel for ",
              call.device.type(), " in this build");
  return kernel(call);
}

// The chunk kernel of the active CPU ISA build, for a CPU driver.
template <typename Call>
typename Call::CpuChunk cpu_chunk() {
  const typename Call::CpuChunk chunk = kernel_slots<Call>().cpu_chunks[int32_t(active_cpu_isa())];
  TORCH_CHECK(chunk != nullptr, "fusedamp internal error: ", Call::kOp,
              " has no chunk kernel for the active CPU ISA");
  return chunk;
}

}  // namespace fusedamp

#define FUSEDAMP_REGISTER_KERNEL(device, Call, kernel)                           \
  static const ::fusedamp::RegisterKernel<Call> fusedamp_registered_##kernel( \
      ::c10::DeviceType::device, &kernel)

// In a file of csrc/cpu/kernels/: registers `chunk` for Call in the ISA build being compiled. A
// baseline build of the drivers alone (FUSEDAMP_CPU_DRIVERS_ONLY, setup.py's native builds on a
// CPU with a better ISA) names the chunk without using it, so that the compiler drops it and
// every kernel it would instantiate.
#ifdef FUSEDAMP_CPU_DRIVERS_ONLY
#define FUSEDAMP_REGISTER_CPU_CHUNK(Call, chunk) static_assert(sizeof(&chunk) != 0)
#else
#define FUSEDAMP_REGISTER_CPU_CHUNK(Call, chunk)                                 \
  static const ::fusedamp::RegisterCpuChunk<Call> fusedamp_registered_##chunk( \
      ::fusedamp::CpuIsa::FUSEDAMP_CPU_ISA_ID, &chunk)
#endif

// In an op's file: the op's one C++ function serves every dispatch key it has kernels for.
#ifdef FUSEDAMP_WITH_CUDA
#define FUSEDAMP_IMPL_CUDA(name, function) \
  TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) { m.impl(name, function); }
#else
#define FUSEDAMP_IMPL_CUDA(name, function)
#endif
#define FUSEDAMP_IMPL(name, function)                                 \
  TORCH_LIBRARY_IMPL(fusedamp, CPU, m) { m.impl(name, function); } \
  FUSEDAMP_IMPL_CUDA(name, function)

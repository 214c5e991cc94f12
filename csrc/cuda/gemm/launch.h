// Host helpers the GEMM launchers share: the per-device opt-in to large dynamic smem, done once
// per kernel and device rather than on every call.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "common/memo.h"

namespace fusedamp::gemm {

// Lets `kernel` launch with `bytes` of dynamic smem on the current device. Above 48 KiB a kernel
// must opt in; the attribute stays set for the kernel on that device, so one call per (kernel,
// device, bytes) is enough.
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  static Memo<3, bool> done(4096);
  const uint64_t device = uint64_t(c10::cuda::current_device());
  done.get({uint64_t(reinterpret_cast<uintptr_t>(kernel)), device, uint64_t(bytes)}, [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  });
}

}  // namespace fusedamp::gemm

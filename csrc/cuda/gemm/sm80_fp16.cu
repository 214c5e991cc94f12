// fp16 instantiations of the sm_80+ mma.sync GEMM kernel (own translation unit: builds in parallel),
// and the check that the device can run them.
#include "cuda/gemm/sm80.cuh"

namespace fusedamp::gemm {

void launch_sm80_fp16(const GemmParams& p, cudaStream_t stream) { launch_sm80<__half>(p, stream); }

bool sm80_kernels_built() {
  // The runtime finds no image (cudaErrorNoKernelImageForDevice) when the build has neither SASS
  // this device runs nor PTX the driver can compile for it: e.g. an 8.0-only build on sm_90, or
  // 8.0;9.0a on sm_100. Every mma.sync kernel is built for the same archs: one stands for all.
  cudaFuncAttributes attributes;
  auto* kernel = gemm_sm80_kernel<__half, true, true, false, Activation::kNone>;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so that it is not reported by a later check
    return false;
  }
  // An image compiled from PTX below 8.0 holds the empty body (sm80.cuh): e.g. the sm_75 SASS of a
  // 7.5;8.0 build on a Turing GPU, or 7.5+PTX compiled by the driver for an sm_86 GPU. ptxVersion
  // is the virtual arch the device's image was compiled from, for SASS and JIT-compiled PTX alike.
  return attributes.ptxVersion >= 80;
}

}  // namespace fusedamp::gemm

// fp16 instantiations of the sm_90a wgmma GEMM kernel, and the check that they were built.
#include "cuda/gemm/sm90.cuh"

namespace fusedamp::gemm {

void launch_sm90_fp16(const GemmParams& p, Sm90Schedule schedule, int sm_count,
                      cudaStream_t stream) {
  launch_sm90<__half>(p, schedule, sm_count, stream);
}

bool sm90_kernels_built() {
  // Only the sm_90a body declares its mbarriers in static smem: a kernel without static smem is
  // the empty body built for another target (e.g. 9.0 without the "a"), which must not run.
  cudaFuncAttributes attributes;
  auto* kernel =
      gemm_sm90_kernel<Sm90Schedule::kCooperative, __half, true, true, false, Activation::kNone>;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // no sm_90 image for this device: clear the non-sticky error
    return false;
  }
  return attributes.sharedSizeBytes > 0;
}

}  // namespace fusedamp::gemm

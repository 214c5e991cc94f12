// bf16 instantiations of the sm_80+ mma.sync GEMM kernel (own translation unit: builds in parallel).
#include "cuda/gemm/sm80.cuh"

namespace fusedamp::gemm {
void launch_sm80_bf16(const GemmParams& p, cudaStream_t stream) {
  launch_sm80<__nv_bfloat16>(p, stream);
}
}  // namespace fusedamp::gemm

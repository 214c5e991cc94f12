// bf16 instantiations of the sm_90a wgmma GEMM kernel (own translation unit: builds in parallel).
#include "cuda/gemm/sm90.cuh"

namespace fusedamp::gemm {
void launch_sm90_bf16(const GemmParams& p, Sm90Schedule schedule, int sm_count,
                      cudaStream_t stream) {
  launch_sm90<__nv_bfloat16>(p, schedule, sm_count, stream);
}
}  // namespace fusedamp::gemm

// Interface of the per-chunk CPU kernels. kernels_impl.h is compiled once per ISA
// (kernels_{avx512,avx2,baseline}.cpp); ops.cpp picks one table at run time.
#pragma once

#include "fusedamp/math/adamw.h"
#include "fusedamp/math/sgd.h"

namespace fusedamp::cpu {

struct AdamWKernelArgs {
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  AdamWCoefficients coefficients;
  float grad_multiplier;  // inv_grad_scale * clip_coef
  bool write_grad;
  bool amsgrad;
};

struct SgdKernelArgs {
  DType param_dtype;
  DType grad_dtype;
  MasterKind master_kind;
  SgdCoefficients coefficients;
  float grad_multiplier;
  bool write_grad;
};

// Each function works on elements [begin, end) of one tensor of each list.
struct KernelTable {
  const char* isa;
  // grad *= inv_scale; returns whether any element read was non-finite.
  bool (*unscale)(void* grad, DType dtype, int64_t begin, int64_t end, float inv_scale);
  // Read-only; *sum_of_squares = sum((grad * multiplier)^2); returns any non-finite.
  bool (*check)(const void* grad, DType dtype, int64_t begin, int64_t end, float multiplier,
                float* sum_of_squares);
  void (*adamw)(const AdamWTensorPointers& tensor, const AdamWKernelArgs& args, int64_t begin,
                int64_t end);
  void (*sgd)(const SgdTensorPointers& tensor, const SgdKernelArgs& args, int64_t begin,
              int64_t end);
};

extern const KernelTable kAvx512Kernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kBaselineKernels;

// The table in use: the best the CPU supports, or FUSEDAMP_CPU_ISA / set_kernels_isa's choice.
const KernelTable& kernels();
// Selects "avx512", "avx2" or "baseline" (errors if the CPU lacks it); returns the old name.
std::string set_kernels_isa(const std::string& isa);

// How many threads the CPU ops' at::parallel_for really runs on (torch.get_num_threads() when
// the build has OpenMP; 1 when it silently lost it).
int64_t parallel_for_threads();

}  // namespace fusedamp::cpu

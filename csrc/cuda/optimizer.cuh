// What the CUDA AdamW and SGD steps share: the elements per thread, the check of a host lr under
// graph capture, and the step-counter increment that follows the update.
#pragma once

#include <vector>

#include "fusedamp/step_inputs.h"

namespace fusedamp {
struct AdamWCall;
struct SgdCall;
}  // namespace fusedamp

namespace fusedamp::cuda {

// The update kernels of the coded modes ([note: state codecs]): bf16 / 8-bit states or
// stochastically rounded params (cuda/adamw_coded.cu, cuda/sgd_coded.cu); the step counts are
// left to the caller.
void adamw_coded_cuda(const AdamWCall& call);
void sgd_coded_cuda(const SgdCall& call);

// Elements per thread per iteration of the optimizer kernels: with four to six lists per element
// that is already 50-100 bytes in flight per thread (one 128-bit access per fp32 list), and the
// kernels stay within ~64 registers, four 256-thread blocks per SM.
constexpr int kOptimizerElements = 4;

// A step whose lr was read on the host from a CPU tensor cannot be captured into a CUDA graph:
// every replay would reuse the captured value. Refuses that with a clear error.
void check_host_lr_not_captured(const StepInputs& inputs);

// steps[i] += 1 for every param unless found_inf (a device pointer, or null) is set. Launched
// after the update kernels, which therefore read the count before the step (stream order).
void increment_steps(const std::vector<void*>& steps, const float* found_inf);

}  // namespace fusedamp::cuda

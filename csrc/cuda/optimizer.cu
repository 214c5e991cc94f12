// The host side of what the CUDA optimizer steps share, and the step-counter kernel.
#include "cuda/optimizer.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace fusedamp::cuda {
namespace {

// As many counters as one launch's 4 KB of parameters holds.
constexpr int kMaxStepCounters = 480;

struct StepCounters {
  float* steps[kMaxStepCounters];
  int32_t count;
};
static_assert(sizeof(StepCounters) + sizeof(float*) <= 4096, "kernel parameters exceed 4 KB");

__global__ void __launch_bounds__(kMaxStepCounters)
    increment_steps_kernel(const __grid_constant__ StepCounters counters, const float* found_inf) {
  if (found_inf != nullptr && found_non_finite(*found_inf)) return;
  if (int32_t(threadIdx.x) < counters.count) *counters.steps[threadIdx.x] += 1.0f;
}

}  // namespace

void check_host_lr_not_captured(const StepInputs& inputs) {
  if (!inputs.host_lr_from_tensor) return;
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "fusedamp: the optimizer step's lr is a CPU "
              "tensor, read once when the step is issued, but the step is being captured into a "
              "CUDA graph: every replay would reuse the captured lr. Put lr on the device (e.g. "
              "torch.tensor(1e-3, device='cuda')) to change it between replays.");
}

void increment_steps(const std::vector<void*>& steps, const float* found_inf) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < steps.size(); first += kMaxStepCounters) {
    StepCounters counters{};
    counters.count = int32_t(std::min(steps.size() - first, size_t(kMaxStepCounters)));
    for (int32_t i = 0; i < counters.count; ++i) counters.steps[i] = static_cast<float*>(steps[first + i]);
    increment_steps_kernel<<<1, kMaxStepCounters, 0, stream>>>(counters, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace fusedamp::cuda

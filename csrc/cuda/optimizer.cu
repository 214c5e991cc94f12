// The host side of the CUDA optimizer steps' shared inputs, and the step-counter kernel.
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
  if (step_skipped(found_inf)) return;
  if (int32_t(threadIdx.x) < counters.count) *counters.steps[threadIdx.x] += 1.0f;
}

// Whether the work queued on the current stream is being captured into a CUDA graph.
bool current_stream_capturing() {
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

StepInputs step_inputs(double lr, const c10::optional<at::Tensor>& lr_tensor,
                       const c10::optional<at::Tensor>& inv_grad_scale,
                       const c10::optional<at::Tensor>& found_inf,
                       const c10::optional<at::Tensor>& clip_coef) {
  auto device_pointer = [](const c10::optional<at::Tensor>& t) -> const float* {
    return t ? t->data_ptr<float>() : nullptr;
  };
  StepInputs inputs{device_pointer(found_inf), device_pointer(inv_grad_scale),
                    device_pointer(clip_coef), nullptr, lr};
  if (lr_tensor && lr_tensor->is_cpu()) {
    // Read now, so a graph captured now would replay this value forever, whatever the tensor holds.
    TORCH_CHECK(!current_stream_capturing(), "fusedamp: the optimizer step's lr is a CPU tensor, "
                "read once when the step is issued, but the step is being captured into a CUDA "
                "graph: every replay would reuse the captured lr. Put lr on the device (e.g. "
                "torch.tensor(1e-3, device='cuda')) to change it between replays.");
    inputs.host_lr = double(*lr_tensor->data_ptr<float>());
  } else {
    inputs.lr = device_pointer(lr_tensor);
  }
  return inputs;
}

void increment_steps(at::TensorList steps, const c10::optional<at::Tensor>& found_inf) {
  const float* skip_flag = found_inf ? found_inf->data_ptr<float>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < steps.size(); first += kMaxStepCounters) {
    StepCounters counters{};
    counters.count = int32_t(std::min(steps.size() - first, size_t(kMaxStepCounters)));
    for (int32_t i = 0; i < counters.count; ++i) counters.steps[i] = steps[first + i].data_ptr<float>();
    increment_steps_kernel<<<1, kMaxStepCounters, 0, stream>>>(counters, skip_flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace fusedamp::cuda

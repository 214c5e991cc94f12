// The Python module fusedamp._C: importing it registers the ops; it also exposes build facts
// and test hooks that are not tensor ops (CPU ISA selection, the launch planner).
#include <torch/extension.h>

#include "cpu/kernels.h"
#include "fusedamp/multi_tensor_plan.h"

namespace {

// (launch, slot, tensor, chunk) for every block the CUDA launcher would run.
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> plan_launches_for_test(
    const std::vector<int64_t>& numels, int64_t chunk_size, int32_t max_tensors, int32_t max_blocks) {
  TORCH_CHECK_VALUE(chunk_size > 0 && max_tensors > 0 && max_blocks > 0,
                    "plan_launches: chunk_size, max_tensors and max_blocks must be positive");
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> blocks;
  const auto launches = fusedamp::plan_launches(numels, chunk_size, max_tensors, max_blocks);
  for (size_t l = 0; l < launches.size(); ++l) {
    const auto& launch = launches[l];
    for (size_t b = 0; b < launch.block_slot.size(); ++b) {
      const int32_t slot = launch.block_slot[b];
      blocks.emplace_back(int64_t(l), slot, launch.tensors[slot], launch.block_chunk[b]);
    }
  }
  return blocks;
}

// (launch, slot, tensor, begin, count) for every block, as the CUDA kernels find their work:
// from the per-slot ranges of each launch, looked up by block index with locate_chunk.
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> locate_chunks_for_test(
    const std::vector<int64_t>& numels, int64_t chunk_size, int32_t max_tensors, int32_t max_blocks) {
  TORCH_CHECK_VALUE(chunk_size > 0 && max_tensors > 0 && max_blocks > 0,
                    "locate_chunks: chunk_size, max_tensors and max_blocks must be positive");
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> blocks;
  const auto launches = fusedamp::plan_launches(numels, chunk_size, max_tensors, max_blocks);
  for (size_t l = 0; l < launches.size(); ++l) {
    const auto& launch = launches[l];
    const fusedamp::SlotRanges ranges = fusedamp::slot_ranges(launch);
    std::vector<int64_t> slot_numels;
    for (const int64_t tensor : launch.tensors) slot_numels.push_back(numels[tensor]);
    for (int32_t b = 0; b < int32_t(launch.block_slot.size()); ++b) {
      const fusedamp::ChunkLocation chunk = fusedamp::locate_chunk(
          ranges.first_block.data(), ranges.first_chunk.data(), slot_numels.data(),
          int32_t(launch.tensors.size()), b, chunk_size);
      blocks.emplace_back(int64_t(l), chunk.slot, launch.tensors[chunk.slot], chunk.begin, chunk.count);
    }
  }
  return blocks;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("cpu_isa", [] { return std::string(fusedamp::cpu::kernels().isa); },
        "The CPU kernel build in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", &fusedamp::cpu::set_kernels_isa, py::arg("isa"),
        "Switch the CPU kernels to avx512, avx2 or baseline; returns the previous choice.");
  m.def("plan_launches", &plan_launches_for_test, py::arg("numels"), py::arg("chunk_size"),
        py::arg("max_tensors"), py::arg("max_blocks"),
        "The multi-tensor launch plan as (launch, slot, tensor, chunk) per block.");
  m.def("locate_chunks", &locate_chunks_for_test, py::arg("numels"), py::arg("chunk_size"),
        py::arg("max_tensors"), py::arg("max_blocks"),
        "Each block's work as the CUDA kernels find it: (launch, slot, tensor, begin, count).");
#ifdef FUSEDAMP_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
}

// Host-side partitioning of a tensor list into fixed-size chunks and of the chunks into kernel
// launches whose metadata fits a fixed-size parameter struct, and the CUDA launcher's settings
// (chunk size, kernel parameter budget). Used by the CUDA launcher (one block per chunk) and by
// the CPU backend (one parallel task per chunk), and unit-tested on CPU.
#pragma once

#include <stdint.h>

#include <atomic>
#include <vector>

#include "fusedamp/macros.h"

namespace fusedamp {

// One unit of work: elements [chunk * chunk_size, min(numel, (chunk + 1) * chunk_size)) of
// tensor `tensor` (an index into the caller's list). Sizes are 64-bit: a tensor may exceed 2^31.
struct ChunkTask {
  int64_t tensor;
  int64_t chunk;
};

// One kernel launch: `tensors` lists the caller's tensor indices in slot order; each block
// names a slot (not a tensor index), so the launch metadata only holds `tensors.size()` pointers.
struct LaunchBatch {
  std::vector<int64_t> tensors;
  std::vector<int32_t> block_slot;
  std::vector<int64_t> block_chunk;
};

inline int64_t chunk_count(int64_t numel, int64_t chunk_size) {
  return (numel + chunk_size - 1) / chunk_size;
}

// Every chunk of every non-empty tensor, in list order. Zero-element tensors produce no task
// (so they can never be read or written, whatever their position in the list).
inline std::vector<ChunkTask> plan_chunks(const std::vector<int64_t>& numels, int64_t chunk_size) {
  std::vector<ChunkTask> tasks;
  for (int64_t t = 0; t < int64_t(numels.size()); ++t) {
    const int64_t chunks = chunk_count(numels[t], chunk_size);
    for (int64_t c = 0; c < chunks; ++c) tasks.push_back({t, c});
  }
  return tasks;
}

// Groups the chunks into launches of at most max_tensors slots and max_blocks blocks. A tensor
// whose chunks do not fit in the current launch continues, in a fresh slot, in the next one.
inline std::vector<LaunchBatch> plan_launches(const std::vector<int64_t>& numels, int64_t chunk_size,
                                              int32_t max_tensors, int32_t max_blocks) {
  std::vector<LaunchBatch> launches;
  LaunchBatch current;
  for (const ChunkTask& task : plan_chunks(numels, chunk_size)) {
    const bool needs_slot = current.tensors.empty() || current.tensors.back() != task.tensor;
    if (int32_t(current.block_slot.size()) == max_blocks ||
        (needs_slot && int32_t(current.tensors.size()) == max_tensors)) {
      launches.push_back(std::move(current));
      current = LaunchBatch();
    }
    if (current.tensors.empty() || current.tensors.back() != task.tensor) {
      current.tensors.push_back(task.tensor);
    }
    current.block_slot.push_back(int32_t(current.tensors.size()) - 1);
    current.block_chunk.push_back(task.chunk);
  }
  if (!current.block_slot.empty()) launches.push_back(std::move(current));
  return launches;
}

// [note: kernel parameter budget] A CUDA launch takes its tensors' metadata as kernel parameters,
// never through device memory (no copy, nothing to keep alive, CUDA graphs capture it). Their
// budget is 4 KB everywhere, and 32764 bytes with CUDA >= 12.1 (toolkit and driver) on compute
// capability >= 7.0: both budgets are compiled, the launcher picks one per call on the host. A
// launch carries only the lists its kernel reads (a bit mask of list indices), so that one
// launch holds a whole optimizer step of a few hundred tensors.
constexpr int64_t kSmallKernelParamBytes = 4096;
constexpr int64_t kLargeKernelParamBytes = 32764;

constexpr uint32_t list_bit(int32_t list) { return 1u << list; }

constexpr int32_t list_count(uint32_t lists) {
  return lists == 0 ? 0 : int32_t(lists & 1u) + list_count(lists >> 1);
}

// The position of list `list` among the carried lists `lists` (-1: not carried).
constexpr int32_t list_position(uint32_t lists, int32_t list) {
  return (lists >> list) & 1u ? list_count(lists & ((1u << list) - 1u)) : -1;
}

// The launch metadata's bytes (cuda/multi_tensor_apply.cuh, ChunkMetadata): per slot a pointer
// per carried list, the numel and first chunk (8 bytes each) and the first block (4); besides,
// the block offset and chunk size (8 each), the slot count (4) and padding (4).
constexpr int64_t kMetadataFixedBytes = 24;
constexpr int64_t metadata_slot_bytes(int32_t lists) { return 8 * int64_t(lists) + 20; }

// Slots (tensors) of one launch whose kernel carries `lists` lists and `args_bytes` bytes of
// arguments of its own within `param_bytes` of kernel parameters.
constexpr int32_t metadata_slots(int32_t lists, int64_t param_bytes, int64_t args_bytes) {
  return int32_t((param_bytes - args_bytes - kMetadataFixedBytes) / metadata_slot_bytes(lists));
}

// The CUDA launcher's settings, read when a multi-tensor op is issued: elements per chunk (one
// block each), the kernel parameter budget (0: the largest the device and driver allow, else
// kSmallKernelParamBytes or kLargeKernelParamBytes where allowed), the grad ops' unroll depth and
// the coded kernels' layout. Run-time settings, so that a tuning sweep times every variant in one
// process; the norm of check_and_norm_ sums per-chunk partials, so its bits are those of one chunk
// size (the optimizers' bits are the same under every setting).
constexpr int64_t kDefaultChunkSize = int64_t(1) << 16;
constexpr int64_t kMinChunkSize = int64_t(1) << 12;  // whole iterations of the coded kernels
constexpr int64_t kMaxChunkSize = int64_t(1) << 24;

// The grad ops' 16-byte pieces per thread and iteration ([note: strided pieces]): all loaded
// before the first store, so a thread has that many in flight. Each depth is its own kernel.
constexpr int64_t kDefaultGradUnroll = 4;

// The runs of 4 values per thread and iteration of the optimizer kernels with 8-bit states ([note:
// coded layouts]): 1, a codec block over two warps, its scale reduced through shared memory
// between two barriers; 2, a codec block per warp, reduced within the warp. Each is its own kernel.
constexpr int64_t kDefaultCodedRuns = 1;

struct LaunchSettings {
  std::atomic<int64_t> chunk_size{kDefaultChunkSize};
  std::atomic<int64_t> param_bytes{0};
  std::atomic<int64_t> grad_unroll{kDefaultGradUnroll};
  std::atomic<int64_t> coded_runs{kDefaultCodedRuns};
};

inline LaunchSettings& launch_settings() {
  static LaunchSettings settings;
  return settings;
}

inline bool valid_chunk_size(int64_t chunk_size) {
  return chunk_size >= kMinChunkSize && chunk_size <= kMaxChunkSize && (chunk_size & (chunk_size - 1)) == 0;
}

inline bool valid_grad_unroll(int64_t unroll) { return unroll == 2 || unroll == 4 || unroll == 8; }

inline bool valid_coded_runs(int64_t runs) { return runs == 1 || runs == 2; }

inline bool valid_param_bytes(int64_t param_bytes) {
  return param_bytes == 0 || param_bytes == kSmallKernelParamBytes || param_bytes == kLargeKernelParamBytes;
}

// [note: strided pieces] The element of an iteration that value j of thread `thread` holds when
// each thread takes pieces of `piece` consecutive elements, `threads` pieces apart: piece u of
// every thread of a block lies in one run of threads * piece elements.
FUSEDAMP_HOST_DEVICE int32_t strided_piece_offset(int32_t j, int32_t thread, int32_t piece, int32_t threads) {
  return ((j / piece) * threads + thread) * piece + j % piece;
}

constexpr int32_t kWarpThreads = 32;

// [note: coded layouts] The element of an iteration of a coded optimizer kernel that value j of
// thread `thread` holds when each thread takes `runs` runs of kCodedRun values: the threads of each
// codec block (codec_block elements, codec_block / (kCodedRun * runs) threads) hold it with their
// runs side by side ([note: strided pieces] within those threads), so every warp access is
// contiguous. With two runs a codec block is one warp's, its scale a reduction within the warp.
constexpr int32_t kCodedRun = 4;

FUSEDAMP_HOST_DEVICE int32_t coded_element_offset(int32_t j, int32_t thread, int32_t runs, int32_t codec_block) {
  const int32_t block_threads = codec_block / (kCodedRun * runs);
  return (thread / block_threads) * codec_block +
         strided_piece_offset(j, thread % block_threads, kCodedRun, block_threads);
}

// [note: per-tensor reduction] The blocks of one multi-tensor call, numbered across its launches
// (block_offset + block index), take the chunks in list order, so tensor t owns the consecutive
// blocks [first, first + count): a kernel writing one partial per block leaves each tensor's
// partials side by side, ready to be reduced per tensor.
struct BlockRange {
  int64_t first;
  int64_t count;
};

inline std::vector<BlockRange> tensor_block_ranges(const std::vector<int64_t>& numels,
                                                   int64_t chunk_size) {
  std::vector<BlockRange> ranges;
  ranges.reserve(numels.size());
  int64_t first = 0;
  for (const int64_t numel : numels) {
    const int64_t count = chunk_count(numel, chunk_size);
    ranges.push_back({first, count});
    first += count;
  }
  return ranges;
}

// The compact form of a LaunchBatch that a CUDA kernel receives. A slot's blocks are consecutive
// and work on consecutive chunks, so two numbers per slot replace a per-block table, and the
// number of blocks in one launch is no longer bounded by the size of the kernel parameters.
struct SlotRanges {
  std::vector<int32_t> first_block;  // index in the launch of the slot's first block
  std::vector<int64_t> first_chunk;  // the chunk of its tensor that block works on
};

inline SlotRanges slot_ranges(const LaunchBatch& launch) {
  SlotRanges ranges;
  for (size_t b = 0; b < launch.block_slot.size(); ++b) {
    if (b == 0 || launch.block_slot[b] != launch.block_slot[b - 1]) {
      ranges.first_block.push_back(int32_t(b));
      ranges.first_chunk.push_back(launch.block_chunk[b]);
    }
  }
  return ranges;
}

// Elements [begin, begin + count) of the tensor in `slot`.
struct ChunkLocation {
  int32_t slot;
  int64_t begin;
  int64_t count;
};

// The work of block `block` of a launch described by slot_ranges (arrays of `slots` entries):
// the last slot starting at or before the block, found by binary search.
FUSEDAMP_HOST_DEVICE ChunkLocation locate_chunk(const int32_t* first_block, const int64_t* first_chunk,
                                                const int64_t* numels, int32_t slots, int32_t block,
                                                int64_t chunk_size) {
  int32_t low = 0;
  int32_t high = slots - 1;
  while (low < high) {
    const int32_t middle = (low + high + 1) / 2;
    if (first_block[middle] <= block) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  const int64_t begin = (first_chunk[low] + (block - first_block[low])) * chunk_size;
  const int64_t left = numels[low] - begin;
  return {low, begin, left < chunk_size ? left : chunk_size};
}

}  // namespace fusedamp

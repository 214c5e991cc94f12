// The CUDA multi-tensor launcher (one block per chunk, metadata passed by value) and the
// register staging that lets the shared per-element math run on vector loads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <limits>
#include <vector>

#include "fusedamp/multi_tensor_plan.h"

namespace fusedamp::cuda {

// 64K elements per block: enough work to amortize a block's start (slot lookup, coefficients),
// and a 100M-parameter model still spreads over ~1500 blocks.
constexpr int64_t kChunkSize = int64_t(1) << 16;
// 256 threads: several blocks per SM keep the memory system busy while one drains, and the
// register allocator has room (at 512, ptxas spilled in the fp32 AdamW kernel to fit 64 regs).
constexpr int kBlockThreads = 256;
// Kernel parameters are limited to 4 KB: the metadata takes at most this much, the op's own
// arguments the rest (checked where a kernel is launched).
constexpr size_t kMaxKernelParamBytes = 4096;
constexpr size_t kMaxMetadataBytes = 3584;

// What one launch works on: the tensors of kLists parallel lists in up to kMaxTensors slots and,
// per slot, its range of blocks (see SlotRanges). Passed by value: no copy to the device.
template <int kLists>
struct ChunkMetadata {
  // Per slot: kLists pointers, numel, first_chunk, first_block; 16 bytes for the rest.
  static constexpr int kMaxTensors = int((kMaxMetadataBytes - 16) / (kLists * 8 + 20));

  void* pointers[kLists][kMaxTensors];  // base of each list's tensor (null: list not used)
  int64_t numels[kMaxTensors];
  int64_t first_chunk[kMaxTensors];
  int64_t block_offset;  // blocks of the same call in earlier launches: indexes per-block output
  int32_t first_block[kMaxTensors];
  int32_t slots;
};

template <int kLists>
__device__ __forceinline__ ChunkLocation this_chunk(const ChunkMetadata<kLists>& meta) {
  return locate_chunk(meta.first_block, meta.first_chunk, meta.numels, meta.slots,
                      int32_t(blockIdx.x), kChunkSize);
}

// The chunk's first element in list `list` (null stays null: unused lists carry no pointer).
template <typename T, int kLists>
__device__ __forceinline__ T* chunk_pointer(const ChunkMetadata<kLists>& meta, int list,
                                            const ChunkLocation& chunk) {
  T* base = static_cast<T*>(meta.pointers[list][chunk.slot]);
  return base == nullptr ? nullptr : base + chunk.begin;
}

// E consecutive elements of one list held in registers. The per-element math functions take a
// pointer and an index, so they run unchanged on `values` (fully unrolled, the array stays in
// registers) while memory is touched only here: with vector accesses of up to 16 bytes when
// the chunk is aligned and the group complete, else element by element within bounds.
template <typename T, int E>
struct ElementGroup {
  static constexpr int kPiece = E * sizeof(T) < 16 ? E : int(16 / sizeof(T));
  static_assert(E % kPiece == 0, "ElementGroup: E must be a whole number of vector pieces");
  struct alignas(kPiece * sizeof(T)) Piece {
    T values[kPiece];
  };

  T values[E];

  static __device__ __forceinline__ bool aligned(const T* pointer) {
    return reinterpret_cast<uintptr_t>(pointer) % sizeof(Piece) == 0;
  }

  // Elements past `count` read as zero: computed on like the others, never stored.
  __device__ __forceinline__ void load(const T* chunk, int first, int count, bool vector) {
    if (vector) {
#pragma unroll
      for (int p = 0; p < E / kPiece; ++p) {
        const Piece piece = reinterpret_cast<const Piece*>(chunk + first)[p];
#pragma unroll
        for (int j = 0; j < kPiece; ++j) values[p * kPiece + j] = piece.values[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) values[j] = first + j < count ? chunk[first + j] : T(0);
    }
  }

  __device__ __forceinline__ void store(T* chunk, int first, int count, bool vector) const {
    if (vector) {
#pragma unroll
      for (int p = 0; p < E / kPiece; ++p) {
        Piece piece;
#pragma unroll
        for (int j = 0; j < kPiece; ++j) piece.values[j] = values[p * kPiece + j];
        reinterpret_cast<Piece*>(chunk + first)[p] = piece;
      }
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) {
        if (first + j < count) chunk[first + j] = values[j];
      }
    }
  }
};

// Whether every pointer allows the vector accesses of ElementGroup<T, E> (null does). A bitwise
// and, not &&: short-circuit branches made ptxas keep the flag in local memory.
template <int E, typename... T>
__device__ __forceinline__ bool all_aligned(const T*... pointers) {
  return (int(ElementGroup<T, E>::aligned(pointers)) & ...) != 0;
}

// Calls body(first, vector) for each group of E elements this thread owns in a chunk of `count`
// elements; `vector`: the group is complete and the chunk aligned. Consecutive threads own
// consecutive groups, so each warp access is contiguous.
template <int E, typename Body>
__device__ __forceinline__ void for_each_group(int count, bool aligned, Body&& body) {
  for (int first = int(threadIdx.x) * E; first < count; first += kBlockThreads * E) {
    body(first, aligned && first + E <= count);
  }
}

// One pointer per tensor of `tensors`, or `count` nulls for an empty (unused) list.
inline std::vector<void*> data_pointers(at::TensorList tensors, size_t count) {
  std::vector<void*> pointers(count, nullptr);
  for (size_t i = 0; i < tensors.size(); ++i) pointers[i] = tensors[i].data_ptr();
  return pointers;
}

inline std::vector<int64_t> numels_of(at::TensorList tensors) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const at::Tensor& t : tensors) numels.push_back(t.numel());
  return numels;
}

inline int64_t total_chunks(const std::vector<int64_t>& numels) {
  int64_t chunks = 0;
  for (const int64_t numel : numels) chunks += chunk_count(numel, kChunkSize);
  return chunks;
}

// Launches kernel(metadata, args) on the current stream until every chunk of every non-empty
// tensor had its block: pointers[l][t] is tensor t of list l, numels[t] its element count in
// every list. Blocks of one launch never exceed the grid limit of 2^31 - 1.
template <int kLists, typename Kernel, typename Args>
void launch_chunks(Kernel kernel, const std::array<std::vector<void*>, kLists>& pointers,
                   const std::vector<int64_t>& numels, const Args& args) {
  using Metadata = ChunkMetadata<kLists>;
  static_assert(sizeof(Metadata) <= kMaxMetadataBytes, "ChunkMetadata outgrew its budget");
  static_assert(sizeof(Metadata) + sizeof(Args) <= kMaxKernelParamBytes,
                "kernel parameters exceed 4 KB: shrink the op's argument struct");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t block_offset = 0;
  for (const LaunchBatch& launch : plan_launches(numels, kChunkSize, Metadata::kMaxTensors,
                                                 std::numeric_limits<int32_t>::max())) {
    const SlotRanges ranges = slot_ranges(launch);
    Metadata meta{};
    meta.slots = int32_t(launch.tensors.size());
    meta.block_offset = block_offset;
    for (int32_t slot = 0; slot < meta.slots; ++slot) {
      const int64_t tensor = launch.tensors[slot];
      for (int list = 0; list < kLists; ++list) meta.pointers[list][slot] = pointers[list][tensor];
      meta.numels[slot] = numels[tensor];
      meta.first_chunk[slot] = ranges.first_chunk[slot];
      meta.first_block[slot] = ranges.first_block[slot];
    }
    const int64_t blocks = int64_t(launch.block_slot.size());
    kernel<<<unsigned(blocks), kBlockThreads, 0, stream>>>(meta, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    block_offset += blocks;
  }
}

}  // namespace fusedamp::cuda

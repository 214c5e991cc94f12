// The CUDA multi-tensor launcher (one block per chunk, the metadata of the lists a kernel reads
// passed by value), the register staging that lets the shared per-element math run on vector
// loads, and the reductions: over a block, and of per-block partials per tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "common/tensor_lists.h"
#include "fusedamp/math/dtypes.h"
#include "fusedamp/multi_tensor_plan.h"

namespace fusedamp::cuda {

// 256 threads: several blocks per SM keep the memory system busy while one drains, and the
// register allocator has room (at 512, ptxas spilled in the fp32 AdamW kernel to fit 64 regs).
constexpr int kBlockThreads = 256;

// What one launch works on ([note: kernel parameter budget]): the tensors of the carried lists
// (bit l of kLists: list l of the op) in up to kSlots slots and, per slot, its range of blocks
// (see SlotRanges). Passed by value: no copy to the device.
template <uint32_t kLists, int32_t kSlots>
struct ChunkMetadata {
  static constexpr uint32_t kListMask = kLists;
  static constexpr int32_t kMaxTensors = kSlots;
  static_assert(kSlots > 0, "ChunkMetadata: no slot fits the kernel parameter budget");

  void* pointers[list_count(kLists)][kSlots];  // base of each carried list's tensor (null: none)
  int64_t numels[kSlots];
  int64_t first_chunk[kSlots];
  int64_t block_offset;  // blocks of the same call in earlier launches: indexes per-block output
  int64_t chunk_size;    // elements per block (the last chunk of a tensor may be shorter)
  int32_t first_block[kSlots];
  int32_t slots;
};

// The metadata of a kernel that reads the lists `kLists` and takes `Args` besides, within
// kParamBytes of kernel parameters.
template <uint32_t kLists, typename Args, int64_t kParamBytes>
using MetadataFor = ChunkMetadata<kLists, metadata_slots(list_count(kLists), kParamBytes, int64_t(sizeof(Args)))>;

template <typename Meta>
__device__ __forceinline__ ChunkLocation this_chunk(const Meta& meta) {
  return locate_chunk(meta.first_block, meta.first_chunk, meta.numels, meta.slots, int32_t(blockIdx.x),
                      meta.chunk_size);
}

// The base of list `list`'s tensor in `slot` (null when the launch does not carry the list: the
// kernel does not read it in this mode; folded at compile time for a constant list).
template <typename T, typename Meta>
__device__ __forceinline__ T* slot_pointer(const Meta& meta, int list, int32_t slot) {
  const int32_t position = list_position(Meta::kListMask, list);
  return position < 0 ? nullptr : static_cast<T*>(meta.pointers[position][slot]);
}

// The chunk's first element in list `list` (null stays null: unused lists carry no pointer).
template <typename T, typename Meta>
__device__ __forceinline__ T* chunk_pointer(const Meta& meta, int list, const ChunkLocation& chunk) {
  T* base = slot_pointer<T>(meta, list, chunk.slot);
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

// kUnroll 16-byte pieces of one list per thread and iteration of kElements elements ([note:
// strided pieces]): piece u of thread t starts at element (u * kBlockThreads + t) * kPiece of the
// iteration, so that a warp's access is 512 consecutive bytes and the thread's kUnroll loads are
// all issued before its first store. For element-wise ops, whose results do not depend on which
// thread computes an element.
template <typename T, int kUnroll>
struct StridedPieces {
  static constexpr int kPiece = int(16 / sizeof(T));
  static constexpr int kValues = kUnroll * kPiece;
  static constexpr int kElements = kBlockThreads * kValues;
  struct alignas(16) Piece {
    T values[kPiece];
  };

  T values[kValues];

  static __device__ __forceinline__ bool aligned(const T* pointer) {
    return reinterpret_cast<uintptr_t>(pointer) % sizeof(Piece) == 0;
  }

  // The iteration's element that values[j] holds.
  static __device__ __forceinline__ int offset(int j) {
    return strided_piece_offset(j, int32_t(threadIdx.x), kPiece, kBlockThreads);
  }

  // The iteration at element `base` of a chunk of `count` elements; `vector`: it is complete and
  // the chunk aligned. Elements past `count` read as zero: computed on like the others, never stored.
  __device__ __forceinline__ void load(const T* chunk, int base, int count, bool vector) {
    if (vector) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const Piece piece = reinterpret_cast<const Piece*>(chunk + base + offset(u * kPiece))[0];
#pragma unroll
        for (int j = 0; j < kPiece; ++j) values[u * kPiece + j] = piece.values[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < kValues; ++j) values[j] = base + offset(j) < count ? chunk[base + offset(j)] : T(0);
    }
  }

  __device__ __forceinline__ void store(T* chunk, int base, int count, bool vector) const {
    if (vector) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        Piece piece;
#pragma unroll
        for (int j = 0; j < kPiece; ++j) piece.values[j] = values[u * kPiece + j];
        reinterpret_cast<Piece*>(chunk + base + offset(u * kPiece))[0] = piece;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kValues; ++j) {
        if (base + offset(j) < count) chunk[base + offset(j)] = values[j];
      }
    }
  }
};

// Calls body(base, vector) for each iteration of StridedPieces<T, kUnroll> over a chunk of
// `count` elements; `vector`: the iteration is complete and the chunk aligned.
template <typename T, int kUnroll, typename Body>
__device__ __forceinline__ void for_each_iteration(int count, bool aligned, Body&& body) {
  constexpr int kElements = StridedPieces<T, kUnroll>::kElements;
  for (int base = 0; base < count; base += kElements) body(base, aligned && base + kElements <= count);
}

// Calls launch(std::integral_constant<int, unroll>) with the grad ops' current unroll depth
// (launch_settings, [note: strided pieces]).
template <typename Launch>
void with_grad_unroll(Launch&& launch) {
  switch (launch_settings().grad_unroll.load(std::memory_order_relaxed)) {
    case 2: return launch(std::integral_constant<int, 2>{});
    case 8: return launch(std::integral_constant<int, 8>{});
    default: return launch(std::integral_constant<int, 4>{});
  }
}

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

inline int64_t total_chunks(const std::vector<int64_t>& numels, int64_t chunk_size) {
  int64_t chunks = 0;
  for (const int64_t numel : numels) chunks += chunk_count(numel, chunk_size);
  return chunks;
}

// The chunk size of the launches an op issues now (launch_settings).
inline int64_t current_chunk_size() { return launch_settings().chunk_size.load(std::memory_order_relaxed); }

// Whether the current device takes 32 KB of kernel parameters ([note: kernel parameter budget]):
// asked once per device (the driver's version cannot change in a process).
inline bool large_kernel_params_supported() {
#if CUDART_VERSION >= 12010
  constexpr int kMaxDevices = 64;
  // 0: not asked yet, 1: no, 2: yes.
  static std::array<std::atomic<int8_t>, kMaxDevices> answers{};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices && answers[device].load(std::memory_order_relaxed) != 0) {
    return answers[device].load(std::memory_order_relaxed) == 2;
  }
  int driver = 0;
  int major = 0;
  C10_CUDA_CHECK(cudaDriverGetVersion(&driver));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const bool supported = driver >= 12010 && major >= 7;
  if (device < kMaxDevices) answers[device].store(supported ? 2 : 1, std::memory_order_relaxed);
  return supported;
#else
  return false;
#endif
}

// The kernel parameter budget of the launches an op issues now: the setting, else the largest
// the device allows; a large budget the device does not allow is refused.
inline int64_t current_param_bytes() {
  const int64_t setting = launch_settings().param_bytes.load(std::memory_order_relaxed);
  if (setting == kSmallKernelParamBytes) return setting;
  const bool large = large_kernel_params_supported();
  TORCH_CHECK(setting == 0 || large, "fusedamp: the multi-tensor launch setting param_bytes=", setting,
              " needs CUDA >= 12.1 (toolkit and driver) and compute capability >= 7.0");
  return large ? kLargeKernelParamBytes : kSmallKernelParamBytes;
}

template <typename T>
struct TypeTag {
  using type = T;
};

template <uint32_t kLists, int64_t kParamBytes, typename KernelFor, typename Args, size_t N>
void launch_chunks_within(KernelFor kernel_for, const std::array<std::vector<void*>, N>& pointers,
                          const std::vector<int64_t>& numels, int64_t chunk_size, const Args& args) {
  using Metadata = MetadataFor<kLists, Args, kParamBytes>;
  static_assert(sizeof(Metadata) + sizeof(Args) <= size_t(kParamBytes), "kernel parameters exceed their budget");
  static_assert(sizeof(Metadata) <=
                    size_t(Metadata::kMaxTensors * metadata_slot_bytes(list_count(kLists)) + kMetadataFixedBytes),
                "ChunkMetadata outgrew metadata_slots' model of it");
  const auto kernel = kernel_for(TypeTag<Metadata>{});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t block_offset = 0;
  for (const LaunchBatch& launch : plan_launches(numels, chunk_size, Metadata::kMaxTensors,
                                                 std::numeric_limits<int32_t>::max())) {
    const SlotRanges ranges = slot_ranges(launch);
    Metadata meta{};
    meta.slots = int32_t(launch.tensors.size());
    meta.block_offset = block_offset;
    meta.chunk_size = chunk_size;
    for (int32_t slot = 0; slot < meta.slots; ++slot) {
      const int64_t tensor = launch.tensors[slot];
      for (int list = 0; list < int(N); ++list) {
        const int32_t position = list_position(kLists, list);
        if (position >= 0) meta.pointers[position][slot] = pointers[list][tensor];
      }
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

// Launches the kernel on the current stream until every chunk of every non-empty tensor had its
// block: pointers[l][t] is tensor t of list l, numels[t] its element count in every list; only
// the lists kLists carry reach the kernel. kernel_for(TypeTag<Metadata>) names the kernel
// instantiated for each budget's metadata. Blocks of one launch never exceed the grid limit of
// 2^31 - 1.
template <uint32_t kLists, typename KernelFor, typename Args, size_t N>
void launch_chunks(KernelFor kernel_for, const std::array<std::vector<void*>, N>& pointers,
                   const std::vector<int64_t>& numels, int64_t chunk_size, const Args& args) {
  static_assert(N <= 32 && (N == 32 || (kLists >> N) == 0), "kLists names a list the op does not have");
  if (current_param_bytes() == kLargeKernelParamBytes) {
    launch_chunks_within<kLists, kLargeKernelParamBytes>(kernel_for, pointers, numels, chunk_size, args);
  } else {
    launch_chunks_within<kLists, kSmallKernelParamBytes>(kernel_for, pointers, numels, chunk_size, args);
  }
}

// The grads of one element type (a kernel instantiation each): their pointers, element counts
// and positions in the call.
struct GradGroup {
  DType dtype;
  std::array<std::vector<void*>, 1> pointers;
  std::vector<int64_t> numels;
  std::vector<int64_t> indices;
};

inline std::vector<GradGroup> group_by_dtype(const TensorLists<1>& grads, const std::vector<DType>& dtypes) {
  std::vector<GradGroup> groups;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const GradGroup& g) { return g.dtype == dtypes[i]; });
    if (group == groups.end()) group = groups.insert(groups.end(), GradGroup{dtypes[i], {}, {}, {}});
    group->pointers[0].push_back(grads.pointers[0][i]);
    group->numels.push_back(grads.numels[i]);
    group->indices.push_back(int64_t(i));
  }
  return groups;
}

// A trivially copyable value shuffled down the warp one 32-bit word at a time, so that structs
// of statistics reduce like plain numbers.
template <typename T>
__device__ __forceinline__ T shuffle_down(T value, int offset) {
  static_assert(sizeof(T) % 4 == 0, "shuffle_down: T must be a whole number of 32-bit words");
  constexpr int kWords = int(sizeof(T) / 4);
  int words[kWords];
  memcpy(words, &value, sizeof(T));
#pragma unroll
  for (int w = 0; w < kWords; ++w) words[w] = __shfl_down_sync(0xffffffffu, words[w], offset);
  memcpy(&value, words, sizeof(T));
  return value;
}

// The block reduction: combine(a, b) over every thread's value in a fixed order (a shuffle tree
// per warp, then the warps in order), so that the result is the same run to run. Every thread of
// the block calls it; the result is complete in thread 0 only. A kernel may call it more than
// once: the barrier before the warps store their values waits for an earlier call's warp 0 to
// have read the same shared storage. The identity is taken by value and assigned, not chosen
// against the shared value with ?: (an lvalue whose address ptxas needed: a 32-byte local-memory
// frame in grad_stats_kernel and its reduction, by ptxas -v; none now).
template <typename T, typename Combine>
__device__ T block_reduce(T value, const T identity, Combine combine) {
  constexpr int kWarps = kBlockThreads / 32;
  // Raw storage: a __shared__ variable cannot run T's default member initializers.
  __shared__ alignas(T) unsigned char storage[kWarps * sizeof(T)];
  T* warp_values = reinterpret_cast<T*>(storage);
  const int lane = int(threadIdx.x) % 32;
  const int warp = int(threadIdx.x) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = combine(value, shuffle_down(value, offset));
  __syncthreads();
  if (lane == 0) warp_values[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = identity;
    if (lane < kWarps) value = warp_values[lane];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = combine(value, shuffle_down(value, offset));
  }
  return value;
}

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const {
    return a + b;
  }
};

// A kernel that writes one partial per block, partials[meta.block_offset + blockIdx.x], is reduced
// per tensor by reduce_per_tensor ([note: per-tensor reduction] in multi_tensor_plan.h): one block
// per tensor combines its partials in block order.
constexpr int kMaxSegments = 160;

struct SegmentBatch {
  int64_t first[kMaxSegments];   // the segment's first partial
  int64_t output[kMaxSegments];  // the output index its total is stored at
  int32_t count[kMaxSegments];   // its partials (0: the total is the identity)
};

template <typename T, typename Combine, typename Store>
__global__ void __launch_bounds__(kBlockThreads)
    reduce_segments_kernel(const __grid_constant__ SegmentBatch batch, const T* partials,
                           const T identity, const Combine combine, const Store store) {
  const int segment = int(blockIdx.x);
  const T* first = partials + batch.first[segment];
  T value = identity;
  for (int i = int(threadIdx.x); i < batch.count[segment]; i += kBlockThreads) {
    value = combine(value, first[i]);
  }
  value = block_reduce(value, identity, combine);
  if (threadIdx.x == 0) store(batch.output[segment], value);
}

// A run of consecutive partials whose combination is stored at `output`.
struct Segment {
  int64_t first;
  int32_t count;  // 0: the stored value is the identity
  int64_t output;
};

// store(segment.output, identity combined with the segment's partials in order) for every
// segment, on the device; partials in device memory, store(index, value) a device functor.
template <typename T, typename Combine, typename Store>
void reduce_segments(const T* partials, const std::vector<Segment>& segments, const T& identity,
                     Combine combine, Store store) {
  static_assert(sizeof(SegmentBatch) + sizeof(T*) + sizeof(T) + sizeof(Combine) + sizeof(Store) <=
                    size_t(kSmallKernelParamBytes), "reduce_segments_kernel: parameters exceed 4 KB");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t begin = 0; begin < segments.size(); begin += kMaxSegments) {
    const size_t count = std::min(segments.size() - begin, size_t(kMaxSegments));
    SegmentBatch batch{};
    for (size_t s = 0; s < count; ++s) {
      batch.first[s] = segments[begin + s].first;
      batch.count[s] = segments[begin + s].count;
      batch.output[s] = segments[begin + s].output;
    }
    reduce_segments_kernel<<<unsigned(count), kBlockThreads, 0, stream>>>(batch, partials, identity,
                                                                         combine, store);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The per-tensor reduction of a launch_chunks call over `numels` whose kernel wrote one partial
// per block: tensor t's partials are stored at outputs[t].
template <typename T, typename Combine, typename Store>
void reduce_per_tensor(const T* partials, const std::vector<int64_t>& numels, int64_t chunk_size,
                       const std::vector<int64_t>& outputs, const T& identity, Combine combine,
                       Store store) {
  const std::vector<BlockRange> ranges = tensor_block_ranges(numels, chunk_size);
  std::vector<Segment> segments;
  segments.reserve(ranges.size());
  for (size_t t = 0; t < ranges.size(); ++t) {
    segments.push_back({ranges[t].first, int32_t(ranges[t].count), outputs[t]});
  }
  reduce_segments(partials, segments, identity, combine, store);
}

}  // namespace fusedamp::cuda

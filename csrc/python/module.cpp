// The Python module fusedamp._C: importing it registers the ops; it also exposes run-time
// settings (CPU ISA, GEMM backend) and build facts, and in _C.testing the test hooks (the
// launch planner, the kernel dispatch, the GEMM kernel choice and the GEMM index math). Plain
// pybind11 on std types, not torch/extension.h: that header (all of libtorch's C++ API) made this
// file the slowest of the build.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <type_traits>

#include "common/memo.h"
#include "cpu/isa.h"
#include "fusedamp/dispatch.h"
#include "fusedamp/gemm/tiles.h"
#include "fusedamp/multi_tensor_plan.h"
#include "ops/adamw.h"
#include "ops/gemm.h"
#include "ops/muon.h"
#include "ops/sgd.h"
#include "python/prepared.h"

namespace py = pybind11;

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

// The blocks of each launch the CUDA launcher plans for `numels` when its kernel carries `lists`
// lists and `args_bytes` bytes of arguments within `param_bytes` ([note: kernel parameter budget]).
std::vector<int64_t> launch_blocks(const std::vector<int64_t>& numels, int64_t chunk_size, int32_t lists,
                                   int64_t param_bytes, int64_t args_bytes) {
  TORCH_CHECK_VALUE(fusedamp::valid_chunk_size(chunk_size), "launch_blocks: chunk_size ", chunk_size,
                    " is not a power of two in [", fusedamp::kMinChunkSize, ", ", fusedamp::kMaxChunkSize, "]");
  TORCH_CHECK_VALUE(param_bytes == fusedamp::kSmallKernelParamBytes || param_bytes == fusedamp::kLargeKernelParamBytes,
                    "launch_blocks: param_bytes must be 4096 or 32764, got ", param_bytes);
  const int32_t slots = fusedamp::metadata_slots(lists, param_bytes, args_bytes);
  TORCH_CHECK_VALUE(slots > 0, "launch_blocks: no tensor fits ", param_bytes, " bytes with ", lists, " lists");
  std::vector<int64_t> blocks;
  for (const auto& launch : fusedamp::plan_launches(numels, chunk_size, slots, INT32_MAX)) {
    blocks.push_back(int64_t(launch.block_slot.size()));
  }
  return blocks;
}

// (lists, argument bytes) of the CUDA kernel of optimizer `op` (adamw, sgd, muon) in a mode: with a
// master or not, its states' codec (float32, bfloat16, int8), coded (stochastic rounding) or not.
template <typename Call>
std::pair<int32_t, int64_t> optimizer_kernel_footprint(bool master, fusedamp::StateCodec codec, bool coded) {
  return {fusedamp::list_count(Call::kernel_lists(master, codec, coded)),
          int64_t(sizeof(fusedamp::StepArgs<Call>))};
}

std::pair<int32_t, int64_t> optimizer_kernel_footprint_for_test(const std::string& op, bool master,
                                                                const std::string& codec, bool coded) {
  const fusedamp::StateCodec c = codec == "float32"    ? fusedamp::StateCodec::kFloat32
                                 : codec == "bfloat16" ? fusedamp::StateCodec::kBFloat16
                                                       : fusedamp::StateCodec::kInt8;
  TORCH_CHECK_VALUE(codec == "float32" || codec == "bfloat16" || codec == "int8",
                    "optimizer_kernel_footprint: codec must be float32, bfloat16 or int8, got ", codec);
  TORCH_CHECK_VALUE(coded || c == fusedamp::StateCodec::kFloat32,
                    "optimizer_kernel_footprint: a ", codec, " codec runs the coded kernels (coded=True)");
  if (op == "adamw") return optimizer_kernel_footprint<fusedamp::AdamWCall>(master, c, coded);
  if (op == "sgd") return optimizer_kernel_footprint<fusedamp::SgdCall>(master, c, coded);
  TORCH_CHECK_VALUE(op == "muon", "optimizer_kernel_footprint: op must be adamw, sgd or muon, got ", op);
  return optimizer_kernel_footprint<fusedamp::MuonCall>(master, c, coded);
}

// The CUDA launcher's settings as a dict.
py::dict cuda_launch_settings() {
  const fusedamp::LaunchSettings& s = fusedamp::launch_settings();
  return py::dict(py::arg("chunk_size") = s.chunk_size.load(), py::arg("param_bytes") = s.param_bytes.load(),
                  py::arg("grad_unroll") = s.grad_unroll.load(), py::arg("coded_runs") = s.coded_runs.load());
}

py::dict set_cuda_launch_settings(std::optional<int64_t> chunk_size, std::optional<int64_t> param_bytes,
                                  std::optional<int64_t> grad_unroll, std::optional<int64_t> coded_runs) {
  TORCH_CHECK_VALUE(!chunk_size || fusedamp::valid_chunk_size(*chunk_size), "set_cuda_launch_settings: chunk_size ",
                    *chunk_size, " is not a power of two in [", fusedamp::kMinChunkSize, ", ",
                    fusedamp::kMaxChunkSize, "]");
  TORCH_CHECK_VALUE(!param_bytes || fusedamp::valid_param_bytes(*param_bytes),
                    "set_cuda_launch_settings: param_bytes must be 0 (the largest allowed), 4096 or 32764, got ",
                    param_bytes.value_or(0));
  TORCH_CHECK_VALUE(!grad_unroll || fusedamp::valid_grad_unroll(*grad_unroll),
                    "set_cuda_launch_settings: grad_unroll must be 2, 4 or 8, got ", grad_unroll.value_or(0));
  TORCH_CHECK_VALUE(!coded_runs || fusedamp::valid_coded_runs(*coded_runs),
                    "set_cuda_launch_settings: coded_runs must be 1 or 2, got ", coded_runs.value_or(0));
  py::dict previous = cuda_launch_settings();
  fusedamp::LaunchSettings& s = fusedamp::launch_settings();
  if (chunk_size) s.chunk_size.store(*chunk_size);
  if (param_bytes) s.param_bytes.store(*param_bytes);
  if (grad_unroll) s.grad_unroll.store(*grad_unroll);
  if (coded_runs) s.coded_runs.store(*coded_runs);
  return previous;
}

using Pair = std::pair<int32_t, int32_t>;

// The GEMM kernels' index math, evaluated on the host for tests/test_gemm_tiles.py.
void def_gemm_tile_hooks(py::module_& m) {
  namespace g = fusedamp::gemm;
  m.def("gemm_tiles", [] {
    using Cooperative = g::Sm90Tile<g::Sm90Schedule::kCooperative>;
    using Pingpong = g::Sm90Tile<g::Sm90Schedule::kPingpong>;
    return py::dict(py::arg("sm80") = py::make_tuple(g::Sm80Tile::kBlockM, g::Sm80Tile::kBlockN,
                                                     g::Sm80Tile::kBlockK, g::Sm80Tile::kThreads),
                    py::arg("sm90") = py::make_tuple(Cooperative::kBlockM, Cooperative::kBlockN,
                                                     Cooperative::kBlockK, Cooperative::kThreads),
                    py::arg("sm90_pingpong") = py::make_tuple(Pingpong::kBlockM, Pingpong::kBlockN,
                                                              Pingpong::kBlockK, Pingpong::kThreads));
  }, "(BLK_M, BLK_N, BLK_K, threads) of each kernel (sm90: its cooperative and ping-pong tiles).");
  m.def("gemm_sm90_ring", [](const std::string& schedule) {
    TORCH_CHECK_VALUE(schedule == "cooperative" || schedule == "pingpong",
                      "gemm_sm90_ring: schedule must be 'cooperative' or 'pingpong'");
    auto describe = [](auto schedule_constant) {
      constexpr g::Sm90Schedule kSchedule = decltype(schedule_constant)::value;
      using Tile = g::Sm90Tile<kSchedule>;
      std::vector<Pair> walks;
      for (int32_t c = 0; c < Tile::kConsumers; ++c) {
        const g::Sm90Walk w = g::sm90_consumer_walk(kSchedule, c);
        walks.emplace_back(w.first, w.step);
      }
      return py::dict(py::arg("stages") = Tile::kStages,
                      py::arg("stage_readers") = Tile::kStageReaders,
                      py::arg("slices") = Tile::kSlices, py::arg("smem_bytes") = Tile::kSmemBytes,
                      py::arg("walks") = walks);
    };
    using S = g::Sm90Schedule;
    if (schedule == "cooperative") return describe(std::integral_constant<S, S::kCooperative>{});
    return describe(std::integral_constant<S, S::kPingpong>{});
  }, py::arg("schedule"),
     "The sm90 stage ring of a schedule: stages, consumers reading each stage, m64 slices per "
     "consumer, dynamic smem bytes, and each consumer's (first, step) walk position.");
  m.def("gemm_sm90_schedule", [](const std::string& backend, int64_t m, int64_t n,
                                 int32_t sm_count) {
    const g::Sm90Schedule s = g::sm90_schedule(g::parse_backend(backend), m, n, sm_count);
    return std::string(s == g::Sm90Schedule::kPingpong ? "pingpong" : "cooperative");
  }, py::arg("backend"), py::arg("m"), py::arg("n"), py::arg("sm_count"),
     "The wgmma schedule ('cooperative' or 'pingpong') a backend runs an (m, n) output with.");
  m.def("gemm_tile_schedule", [](int32_t tiles_m, int32_t tiles_n, int32_t group) {
    TORCH_CHECK_VALUE(tiles_m > 0 && tiles_n > 0 && group > 0, "tile counts must be positive");
    std::vector<Pair> tiles;
    for (int32_t i = 0; i < tiles_m * tiles_n; ++i) {
      const g::TileCoord t = g::tile_of(i, tiles_m, tiles_n, group);
      tiles.emplace_back(t.m, t.n);
    }
    return tiles;
  }, "(tile_m, tile_n) of every linear tile index.");
  m.def("gemm_swizzle", [](int32_t chunks_per_row, int32_t rows) {
    std::vector<int32_t> offsets;
    for (int32_t r = 0; r < rows; ++r) {
      for (int32_t c = 0; c < chunks_per_row; ++c) {
        offsets.push_back(chunks_per_row == 4 ? g::swizzled_offset<4>(r, 8 * c)
                                              : g::swizzled_offset<16>(r, 8 * c));
      }
    }
    return offsets;
  }, "Byte offset of every 16-byte chunk (row-major) of an sm80 tile with 4 or 16 chunks/row.");
  m.def("gemm_swizzle_128b", [](int32_t bytes) {
    std::vector<int32_t> offsets;
    for (int32_t o = 0; o < bytes; o += 16) offsets.push_back(g::swizzle_128b(o));
    return offsets;
  }, "128B-swizzled byte offset of every 16-byte chunk of a buffer.");
  m.def("gemm_ldmatrix_lanes", [](const std::string& operand, bool k_major) {
    std::vector<Pair> lanes;
    for (int32_t lane = 0; lane < 32; ++lane) {
      const g::ChunkIndex c = operand == "a" ? g::ldmatrix_a_lane(lane, k_major)
                                             : g::ldmatrix_b_lane(lane, k_major);
      lanes.emplace_back(c.row, c.chunk);
    }
    return lanes;
  }, "(row, chunk) each lane hands to ldmatrix.x4 for operand 'a' or 'b'.");
  m.def("gemm_mma_elements", [](const std::string& operand) {
    std::vector<std::vector<Pair>> lanes(32);
    const int32_t count = operand == "a" ? 8 : 4;
    for (int32_t lane = 0; lane < 32; ++lane) {
      for (int32_t i = 0; i < count; ++i) {
        const g::Coord c = operand == "a"   ? g::mma_a_element(lane, i)
                           : operand == "b" ? g::mma_b_element(lane, i)
                                            : g::mma_c_element(lane, i);
        lanes[lane].emplace_back(c.row, c.col);
      }
    }
    return lanes;
  }, "Per lane, the (row, col) of each element of the mma.m16n8k16 fragment 'a', 'b' or 'c'.");
  m.def("gemm_sm80_accumulators", [] {
    std::vector<Pair> coords;
    using T = g::Sm80Tile;
    for (int32_t w = 0; w < T::kThreads / 32; ++w)
      for (int32_t lane = 0; lane < 32; ++lane)
        for (int32_t mi = 0; mi < T::kMmaM; ++mi)
          for (int32_t ni = 0; ni < T::kMmaN; ++ni)
            for (int32_t i = 0; i < 4; ++i) {
              const g::Coord c = g::sm80_accumulator(w, lane, mi, ni, i);
              coords.emplace_back(c.row, c.col);
            }
    return coords;
  }, "Block-tile (row, col) of every accumulator of every sm80 thread.");
  m.def("gemm_wgmma_accumulators", [](int32_t n) {
    TORCH_CHECK_VALUE(n == 128 || n == 256, "gemm_wgmma_accumulators: n must be 128 or 256");
    std::vector<Pair> coords;
    for (int32_t t = 0; t < 128; ++t)
      for (int32_t i = 0; i < n / 2; ++i) {
        const g::Coord c = g::wgmma_accumulator(t, i);
        coords.emplace_back(c.row, c.col);
      }
    return coords;
  }, py::arg("n"), "(row, col) in a 64 x n wgmma slice of every accumulator of every thread.");
  m.def("gemm_copy_chunks", [](int32_t threads, int32_t rounds, int32_t chunks_per_row) {
    std::vector<Pair> chunks;
    for (int32_t r = 0; r < rounds; ++r)
      for (int32_t t = 0; t < threads; ++t) {
        const g::ChunkIndex c = g::copy_chunk(t, r, threads, chunks_per_row);
        chunks.emplace_back(c.row, c.chunk);
      }
    return chunks;
  }, "(row, chunk) copied by each (round, thread) of an sm80 tile load.");
  m.def("gemm_chunk_bytes", &g::chunk_bytes, py::arg("row"), py::arg("col"), py::arg("rows"),
        py::arg("cols"), "Valid bytes of the 8-element chunk at (row, col).");
  m.def("gemm_activation", [](const std::vector<float>& z, int32_t activation) {
    std::vector<float> out;
    for (float v : z) out.push_back(g::activate(v, g::Activation(activation)));
    return out;
  }, "The epilogue activation (0 none, 1 relu, 2 gelu, 3 gelu_tanh) on the host.");
  m.def("gemm_wgmma_descriptor", &g::wgmma_descriptor, py::arg("address"), py::arg("leading"),
        py::arg("stride"), "The wgmma smem descriptor of a 128B-swizzled operand.");
  m.def("gemm_choose_kernel", [](const std::string& backend, int32_t cc, bool mma_sync_code,
                                 bool wgmma_code, bool kernel_fits, bool wgmma_fits) {
    constexpr const char* kKernels[] = {"reference", "mma_sync", "wgmma"};
    constexpr const char* kMissing[] = {"", "mma_sync", "wgmma"};
    const g::KernelChoice choice = g::choose_kernel(
        g::parse_backend(backend), {cc, mma_sync_code, wgmma_code, kernel_fits, wgmma_fits});
    return std::make_pair(std::string(kKernels[int32_t(choice.kernel)]),
                          std::string(kMissing[int32_t(choice.missing)]));
  }, py::arg("backend"), py::arg("cc"), py::arg("mma_sync_code"), py::arg("wgmma_code"),
     py::arg("kernel_fits"), py::arg("wgmma_fits"),
     "The CUDA gemm's kernel choice for these facts: (kernel, the kernel whose code the build "
     "lacks and 'auto' warns about, or '').");
}

// For each key in turn, whether the memo (capacity `capacity`) made its value, and the value it
// returned (key * 10, or -1 where make threw: the make of `throw_on` does).
std::vector<std::pair<bool, int64_t>> memo_trace_for_test(const std::vector<int64_t>& keys,
                                                          int64_t capacity, int64_t throw_on) {
  TORCH_CHECK_VALUE(capacity > 0, "memo_trace: capacity must be positive");
  fusedamp::Memo<1, int64_t> memo{size_t(capacity)};
  std::vector<std::pair<bool, int64_t>> trace;
  for (const int64_t key : keys) {
    bool made = false;
    int64_t value = -1;
    try {
      value = memo.get({uint64_t(key)}, [&] {
        made = true;
        if (key == throw_on) throw std::runtime_error("make failed");
        return key * 10;
      });
    } catch (const std::runtime_error&) {
    }
    trace.emplace_back(made, value);
  }
  return trace;
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

// (first, count) of the blocks of each tensor, for the per-tensor reductions.
std::vector<std::pair<int64_t, int64_t>> tensor_block_ranges_for_test(const std::vector<int64_t>& numels,
                                                                      int64_t chunk_size) {
  TORCH_CHECK_VALUE(chunk_size > 0, "tensor_block_ranges: chunk_size must be positive");
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const fusedamp::BlockRange& range : fusedamp::tensor_block_ranges(numels, chunk_size)) {
    ranges.emplace_back(range.first, range.count);
  }
  return ranges;
}

// "param/master" names of the kernel instantiation dispatch.h picks for raw enum values; an
// impossible combination raises instead of running nothing.
std::string dispatch_for_test(int32_t param_dtype, int32_t master_kind) {
  std::string picked;
  fusedamp::with_float_dtype(fusedamp::DType(param_dtype), [&](auto p) {
    fusedamp::with_master_kind<decltype(p)::value>(fusedamp::MasterKind(master_kind), [&](auto m) {
      picked = std::to_string(int32_t(p.value)) + "/" + std::to_string(int32_t(m.value));
    });
  });
  return picked;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("cpu_isa", [] { return std::string(fusedamp::cpu::isa_name(fusedamp::active_cpu_isa())); },
        "The CPU kernel build in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", &fusedamp::cpu::set_isa, py::arg("isa"),
        "Switch the CPU kernels to avx512, avx2 or baseline; returns the previous choice.");
  m.def("cpu_prefetch_blocks", [] { return fusedamp::cpu::prefetch_blocks.load(); },
        "How many codec blocks (256 elements) ahead the CPU optimizer steps prefetch; 0: none.");
  m.def("set_cpu_prefetch_blocks", &fusedamp::cpu::set_prefetch_blocks, py::arg("blocks"),
        "Set the CPU steps' prefetch distance in codec blocks (0 to 8); returns the previous.");
  m.def("gemm_backend", &fusedamp::gemm::backend_name,
        "The CUDA gemm backend: reference, auto, mma_sync, wgmma, wgmma_cooperative or "
        "wgmma_pingpong.");
  m.def("set_gemm_backend", &fusedamp::gemm::set_backend, py::arg("name"),
        "Choose the CUDA gemm backend (reference, auto, mma_sync, wgmma, wgmma_cooperative, "
        "wgmma_pingpong); returns the previous.");
  m.def("parallel_for_threads", &fusedamp::cpu::parallel_for_threads,
        "How many threads the CPU ops' at::parallel_for runs on.");
  m.def("cuda_launch_settings", &cuda_launch_settings,
        "The CUDA multi-tensor launcher's settings: chunk_size (elements per block), param_bytes "
        "(kernel parameter budget; 0: the largest the device allows), grad_unroll (16-byte "
        "pieces in flight per thread in unscale_ and check_and_norm_) and coded_runs (runs of 4 "
        "values per thread in the optimizer kernels with 8-bit states: 1, a codec block over two "
        "warps; 2, one warp's).");
  m.def("set_cuda_launch_settings", &set_cuda_launch_settings, py::arg("chunk_size") = py::none(),
        py::arg("param_bytes") = py::none(), py::arg("grad_unroll") = py::none(),
        py::arg("coded_runs") = py::none(),
        "Set the CUDA launcher's chunk_size (a power of two, 4096 to 2^24), param_bytes (0, 4096 or "
        "32764), grad_unroll (2, 4 or 8) and/or coded_runs (1 or 2) for the ops issued next; returns "
        "the previous settings.");
  fusedamp::def_prepared(m);
  m.def("last_level_cache_bytes", &fusedamp::cpu::last_level_cache_bytes,
        "The last-level cache the CPU optimizers size their param stores by, in bytes.");
#ifdef FUSEDAMP_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif

  // Host evaluations of kernel internals for the tests; not part of the library's surface.
  py::module_ testing = m.def_submodule("testing", "Test hooks: kernel index math on the host.");
  testing.def("plan_launches", &plan_launches_for_test, py::arg("numels"), py::arg("chunk_size"),
              py::arg("max_tensors"), py::arg("max_blocks"),
              "The multi-tensor launch plan as (launch, slot, tensor, chunk) per block.");
  testing.def("locate_chunks", &locate_chunks_for_test, py::arg("numels"), py::arg("chunk_size"),
              py::arg("max_tensors"), py::arg("max_blocks"),
              "Each block's work as the CUDA kernels find it: (launch, slot, tensor, begin, count).");
  testing.def("tensor_block_ranges", &tensor_block_ranges_for_test, py::arg("numels"),
              py::arg("chunk_size"), "(first, count) of each tensor's blocks in a multi-tensor call.");
  testing.def("dispatch_for_test", &dispatch_for_test, py::arg("param_dtype"), py::arg("master_kind"),
              "The 'param/master' kernel dispatch.h picks for raw DType and MasterKind values.");
  testing.def("memo_trace", &memo_trace_for_test, py::arg("keys"), py::arg("capacity"),
              py::arg("throw_on"),
              "(made, value) per key of a Memo, as the GEMM launchers keep tensor maps in one.");
  testing.def("launch_blocks", &launch_blocks, py::arg("numels"), py::arg("chunk_size"), py::arg("lists"),
              py::arg("param_bytes"), py::arg("args_bytes"),
              "Blocks of each CUDA launch for a kernel of `lists` lists and `args_bytes` of arguments.");
  testing.def("strided_pieces", [](int32_t element_bytes, int32_t unroll, int32_t threads) {
    TORCH_CHECK_VALUE((element_bytes == 2 || element_bytes == 4) && unroll > 0 && threads > 0,
                      "strided_pieces: element_bytes must be 2 or 4, unroll and threads positive");
    const int32_t piece = 16 / element_bytes;
    std::vector<std::vector<int32_t>> offsets(threads);
    for (int32_t t = 0; t < threads; ++t) {
      for (int32_t j = 0; j < unroll * piece; ++j) {
        offsets[t].push_back(fusedamp::strided_piece_offset(j, t, piece, threads));
      }
    }
    return offsets;
  }, py::arg("element_bytes"), py::arg("unroll"), py::arg("threads"),
     "The iteration's element each value of each thread holds in unscale_ and the check.");
  testing.def("coded_elements", [](int32_t runs, int32_t threads) {
    TORCH_CHECK_VALUE(fusedamp::valid_coded_runs(runs) && threads > 0,
                      "coded_elements: runs must be 1 or 2 and threads positive");
    std::vector<std::vector<int32_t>> offsets(threads);
    for (int32_t t = 0; t < threads; ++t) {
      for (int32_t j = 0; j < runs * fusedamp::kCodedRun; ++j) {
        offsets[t].push_back(fusedamp::coded_element_offset(j, t, runs, int32_t(fusedamp::kCodecBlock)));
      }
    }
    return offsets;
  }, py::arg("runs"), py::arg("threads"),
     "The iteration's element each value of each thread holds in the coded optimizer kernels.");
  testing.def("optimizer_kernel_footprint", &optimizer_kernel_footprint_for_test, py::arg("op"),
              py::arg("master"), py::arg("codec"), py::arg("coded"),
              "(lists carried, argument bytes) of an optimizer's CUDA kernel in a mode.");
  def_gemm_tile_hooks(testing);
}

// The CPU kernel build in use: the best this CPU supports, or FUSEDAMP_CPU_ISA's / set_isa's.
#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "cpu/launcher.h"

namespace fusedamp {
namespace cpu {
namespace {

#if !defined(FUSEDAMP_BUILT_AVX512) || !defined(FUSEDAMP_BUILT_AVX2) || !defined(FUSEDAMP_BUILT_BASELINE)
#error "setup.py defines FUSEDAMP_BUILT_AVX512, _AVX2 and _BASELINE (which ISAs' kernels exist)"
#endif

// Whether this build of _C has the ISA's kernels (setup.py, FUSEDAMP_CPU_ISAS).
bool built(CpuIsa isa) {
  if (isa == CpuIsa::kAvx512) return FUSEDAMP_BUILT_AVX512;
  if (isa == CpuIsa::kAvx2) return FUSEDAMP_BUILT_AVX2;
  return FUSEDAMP_BUILT_BASELINE;
}

bool cpu_has(CpuIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == CpuIsa::kAvx512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == CpuIsa::kAvx2) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return isa == CpuIsa::kBaseline;
}

CpuIsa checked_isa(const std::string& name) {
  for (const CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kBaseline}) {
    if (name != isa_name(isa)) continue;
    TORCH_CHECK_VALUE(cpu_has(isa), "fusedamp: this CPU does not support the '", name, "' kernels");
    TORCH_CHECK_VALUE(built(isa), "fusedamp: this build has no '", name, "' kernels; rebuild with ",
                      "FUSEDAMP_CPU_ISAS=all to have every ISA's");
    return isa;
  }
  TORCH_CHECK_VALUE(false, "fusedamp: unknown CPU ISA '", name, "'; choose avx512, avx2 or baseline");
}

CpuIsa detect_isa() {
  if (const char* forced = std::getenv("FUSEDAMP_CPU_ISA")) {
    if (*forced) return checked_isa(forced);
  }
  for (const CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kBaseline}) {
    if (cpu_has(isa) && built(isa)) return isa;
  }
  TORCH_CHECK(false, "fusedamp was built with the CPU kernels of another machine's ISA (FUSEDAMP_CPU_ISAS=",
              "native) and this CPU cannot run them; rebuild here, or with FUSEDAMP_CPU_ISAS=all for ",
              "every ISA");
}

int checked_prefetch_blocks(int64_t blocks) {
  TORCH_CHECK_VALUE(blocks >= 0 && blocks <= 8, "fusedamp: the CPU prefetch distance must be 0 to 8 ",
                    "codec blocks, got ", blocks);
  return int(blocks);
}

// [note: block prefetch]: AMD's cores run the steps faster on their hardware prefetchers alone.
int default_prefetch_blocks() {
  if (const char* forced = std::getenv("FUSEDAMP_CPU_PREFETCH")) {
    if (*forced) return checked_prefetch_blocks(std::strtol(forced, nullptr, 10));
  }
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return 0;
#endif
  return 2;
}

const bool prefetch_blocks_chosen = [] {
  prefetch_blocks.store(default_prefetch_blocks());
  return true;
}();

std::atomic<CpuIsa>& active_isa() {
  static std::atomic<CpuIsa> isa{detect_isa()};
  return isa;
}

}  // namespace

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kBaseline: return "baseline";
  }
  return "unknown";
}

std::string set_isa(const std::string& name) { return isa_name(active_isa().exchange(checked_isa(name))); }

int set_prefetch_blocks(int blocks) { return prefetch_blocks.exchange(checked_prefetch_blocks(blocks)); }

int64_t parallel_for_threads() {
  std::vector<std::atomic<bool>> used(at::get_num_threads());
  at::parallel_for(0, int64_t(used.size()) * kChunkSize, kChunkSize, [&](int64_t, int64_t) {
    used[at::get_thread_num()].store(true);
  });
  int64_t count = 0;
  for (const auto& flag : used) count += flag.load();
  return count;
}

int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    std::ifstream size_file("/sys/devices/system/cpu/cpu0/cache/index3/size");
    int64_t size = 0;
    char unit = 'B';
    if (!(size_file >> size) || size <= 0) return int64_t(32) << 20;
    size_file >> unit;
    return unit == 'K' ? size << 10 : unit == 'M' ? size << 20 : unit == 'G' ? size << 30 : size;
  }();
  return bytes;
}

}  // namespace cpu

CpuIsa active_cpu_isa() { return cpu::active_isa().load(); }

}  // namespace fusedamp

// Which CPU kernel build (ISA) the CPU ops run, how many threads they run on, and the cache
// they share.
#pragma once

#include <stdint.h>

#include <atomic>
#include <string>

#include "common/registry.h"

namespace fusedamp::cpu {

const char* isa_name(CpuIsa isa);

// Selects "avx512", "avx2" or "baseline" (an error if the CPU lacks it); returns the old name.
std::string set_isa(const std::string& name);

// How many threads the CPU ops' at::parallel_for really runs on (torch.get_num_threads() when
// the build has OpenMP; 1 when it silently lost it).
int64_t parallel_for_threads();

// How many codec blocks ahead the CPU steps prefetch, 0 for none ([note: block prefetch] in
// cpu/blocks.h): set for the CPU's vendor when _C loads (FUSEDAMP_CPU_PREFETCH overrides it).
// An inline variable, read once per codec block in every ISA's kernels.
inline std::atomic<int> prefetch_blocks{2};

// Sets prefetch_blocks (0 to 8); returns the previous value.
int set_prefetch_blocks(int blocks);

// The last-level cache this CPU's cores share, in bytes: the L3 that Linux lists for cpu0
// (sysconf's L3 can be the whole socket's, ten times what a VM's cores share), else 32 MiB.
int64_t last_level_cache_bytes();

}  // namespace fusedamp::cpu

// Which CPU kernel build (ISA) the CPU ops run, how many threads they run on, and the cache
// they share.
#pragma once

#include <stdint.h>

#include <string>

#include "common/registry.h"

namespace fusedamp::cpu {

const char* isa_name(CpuIsa isa);

// Selects "avx512", "avx2" or "baseline" (an error if the CPU lacks it); returns the old name.
std::string set_isa(const std::string& name);

// How many threads the CPU ops' at::parallel_for really runs on (torch.get_num_threads() when
// the build has OpenMP; 1 when it silently lost it).
int64_t parallel_for_threads();

// The last-level cache this CPU's cores share, in bytes: the L3 that Linux lists for cpu0
// (sysconf's L3 can be the whole socket's, ten times what a VM's cores share), else 32 MiB.
int64_t last_level_cache_bytes();

}  // namespace fusedamp::cpu

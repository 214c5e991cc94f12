// Which CPU kernel build (ISA) the CPU ops run, and how many threads they run on.
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

}  // namespace fusedamp::cpu

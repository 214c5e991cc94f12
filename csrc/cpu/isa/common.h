// What every ISA build of a CPU kernel file includes before its `#pragma GCC target`: all system,
// torch and fusedamp headers with code outside fusedamp's per-ISA namespace. Included after that
// pragma, their inline functions and template instances would be compiled for the ISA, and the
// linker keeps one copy of each for all builds: an AVX-512 copy could then run on an AVX2 CPU.
// (tests/test_build.py disassembles _C to check that no such copy exists.)
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <ATen/Parallel.h>
#include <c10/core/Device.h>

#include "common/registry.h"
#include "common/tensor_lists.h"
#include "cpu/launcher.h"
#include "fusedamp/multi_tensor_plan.h"

// The CPU kernels built for baseline (the compiler's default target: runs on any x86-64 / aarch64).
// System headers come first so that only fusedamp's own functions take this ISA's target.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <type_traits>

#define FUSEDAMP_ISA baseline
#define FUSEDAMP_ISA_NAME "baseline"
#define FUSEDAMP_KERNEL_TABLE kBaselineKernels

#include "cpu/kernels_impl.h"

// The CPU kernels built for avx2.
// System headers come first so that only fusedamp's own functions take this ISA's target.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define FUSEDAMP_ISA avx2
#define FUSEDAMP_ISA_NAME "avx2"
#if defined(__x86_64__)
#define FUSEDAMP_F16C_LANES 8
#endif
#define FUSEDAMP_KERNEL_TABLE kAvx2Kernels
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif
#include "cpu/kernels_impl.h"

// Preamble of the AVX2 build of a CPU kernel file (setup.py generates one source per file and ISA).
#define FUSEDAMP_ISA avx2
#define FUSEDAMP_CPU_ISA_ID kAvx2
#if defined(__x86_64__)
#define FUSEDAMP_F16C_LANES 8
#endif
#include "cpu/isa/common.h"
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif

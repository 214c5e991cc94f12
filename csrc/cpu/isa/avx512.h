// Preamble of the AVX-512 build of a CPU kernel file (setup.py generates one source per file and ISA).
#define FUSEDAMP_ISA avx512
#define FUSEDAMP_CPU_ISA_ID kAvx512
#if defined(__x86_64__)
#define FUSEDAMP_F16C_LANES 16
#endif
#include "cpu/isa/common.h"
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#endif

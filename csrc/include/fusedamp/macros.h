// Portability macros shared by host (g++) and device (nvcc) code.
#pragma once

#if defined(__CUDACC__)
#define FUSEDAMP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDAMP_HOST_DEVICE inline __attribute__((always_inline))
#endif

// Each CPU ISA build of the kernels (see setup.py and csrc/cpu/kernels/) defines FUSEDAMP_ISA before
// including any fusedamp header, so the inline functions of every ISA get their own symbols:
// the linker can then never swap an AVX-512 body into the baseline build (the ODR trap).
#ifndef FUSEDAMP_ISA
#define FUSEDAMP_ISA generic
#endif
#define FUSEDAMP_NAMESPACE_BEGIN \
  namespace fusedamp {           \
  inline namespace FUSEDAMP_ISA {
#define FUSEDAMP_NAMESPACE_END \
  }                            \
  }

// Preamble of the baseline build of a CPU kernel file, which runs on any CPU: it also builds the
// file's driver (FUSEDAMP_CPU_DRIVER), the part that runs whichever ISA's chunk kernels are active.
#define FUSEDAMP_ISA baseline
#define FUSEDAMP_CPU_ISA_ID kBaseline
#define FUSEDAMP_CPU_DRIVER 1
#include "cpu/isa/common.h"

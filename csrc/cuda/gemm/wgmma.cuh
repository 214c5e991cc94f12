// wgmma.mma_async m64nNk16 with fp32 accumulators (N / 2 per thread) for N = 256 and 128, fp16
// and bf16 inputs. The operand lists are long because every accumulator register is named.
#pragma once

#include <stdint.h>

#include <type_traits>

namespace fusedamp::gemm {

// The accumulators' operands, in halves of 64: their numbers in the asm string (D_*) and their
// constraints (ACC_*). asm strings and operand lists must be literal text, hence macros.
#define FUSEDAMP_WGMMA_D_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FUSEDAMP_WGMMA_D_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
  "%124, %125, %126, %127"
#define FUSEDAMP_WGMMA_ACC_0_63 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
  "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
  "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
  "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
  "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
  "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
  "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
  "+f"(d[63])
#define FUSEDAMP_WGMMA_ACC_64_127 \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), \
  "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
  "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), \
  "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
  "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), \
  "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), \
  "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), \
  "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), \
  "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), \
  "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// One wgmma of SHAPE ("m64n256k16", ...) on TYPE ("f16" or "bf16") inputs: D lists the
// accumulators' operand numbers, A and B those of the descriptors, then the accumulate flag's and
// the transposes'; the variadic arguments are the accumulators' constraints.
#define FUSEDAMP_WGMMA(SHAPE, TYPE, D, A, B, ACCUMULATE, TRANS_A, TRANS_B, ...)                 \
  asm volatile("{\n"                                                                            \
               ".reg .pred accumulate;\n"                                                       \
               "setp.ne.b32 accumulate, " ACCUMULATE ", 0;\n"                                   \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" D "}, " A ", " B \
               ", accumulate, 1, 1, " TRANS_A ", " TRANS_B ";\n"                                \
               "}\n"                                                                            \
               : __VA_ARGS__                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(int32_t(kTransA)),              \
                 "n"(int32_t(kTransB)))
#define FUSEDAMP_WGMMA_M64N256K16(TYPE)                                                         \
  FUSEDAMP_WGMMA("m64n256k16", TYPE, FUSEDAMP_WGMMA_D_0_63 ", " FUSEDAMP_WGMMA_D_64_127, "%128", \
                 "%129", "%130", "%131", "%132", FUSEDAMP_WGMMA_ACC_0_63,                        \
                 FUSEDAMP_WGMMA_ACC_64_127)
#define FUSEDAMP_WGMMA_M64N128K16(TYPE)                                                      \
  FUSEDAMP_WGMMA("m64n128k16", TYPE, FUSEDAMP_WGMMA_D_0_63, "%64", "%65", "%66", "%67", "%68", \
                 FUSEDAMP_WGMMA_ACC_0_63)

// d (64, N) (+)= A (64, 16) * B (16, N), A and B read from shared memory through their
// descriptors. accumulate == 0 overwrites d; kTransA / kTransB select MN-major operands.
template <typename T, int kN, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[kN / 2], uint64_t desc_a,
                                               uint64_t desc_b, uint32_t accumulate) {
  static_assert(kN == 256 || kN == 128, "wgmma_m64nNk16: N must be 256 or 128");
  constexpr bool kHalf = std::is_same_v<T, __half>;
  if constexpr (kN == 256 && kHalf) {
    FUSEDAMP_WGMMA_M64N256K16("f16");
  } else if constexpr (kN == 256) {
    FUSEDAMP_WGMMA_M64N256K16("bf16");
  } else if constexpr (kHalf) {
    FUSEDAMP_WGMMA_M64N128K16("f16");
  } else {
    FUSEDAMP_WGMMA_M64N128K16("bf16");
  }
}

#undef FUSEDAMP_WGMMA_M64N128K16
#undef FUSEDAMP_WGMMA_M64N256K16
#undef FUSEDAMP_WGMMA
#undef FUSEDAMP_WGMMA_ACC_64_127
#undef FUSEDAMP_WGMMA_ACC_0_63
#undef FUSEDAMP_WGMMA_D_64_127
#undef FUSEDAMP_WGMMA_D_0_63

}  // namespace fusedamp::gemm

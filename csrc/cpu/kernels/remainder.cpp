// CPU kernels of split_bf16_remainder and join_bf16_remainder (built once per ISA, see
// setup.py): element loops over math/master.h, run in parallel by the drivers.
#include "ops/remainder.h"

#include "fusedamp/math/master.h"

namespace fusedamp::cpu {
inline namespace FUSEDAMP_ISA {
namespace {

void split_chunk(const SplitRemainderCall& call, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    split_bf16_remainder(call.master[i], call.param[i], call.remainder[i]);
  }
}

void join_chunk(const JoinRemainderCall& call, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    call.master[i] = join_bf16_remainder(call.param[i], call.remainder[i]);
  }
}

}  // namespace
}  // namespace FUSEDAMP_ISA

FUSEDAMP_REGISTER_CPU_CHUNK(SplitRemainderCall, split_chunk);
FUSEDAMP_REGISTER_CPU_CHUNK(JoinRemainderCall, join_chunk);

#ifdef FUSEDAMP_CPU_DRIVER
namespace {

template <typename Call>
void run_elementwise(const Call& call) {
  const typename Call::CpuChunk chunk = cpu_chunk<Call>();
  for_each_chunk({call.numel}, [&](int64_t, int64_t begin, int64_t end) { chunk(call, begin, end); });
}

void split_cpu(const SplitRemainderCall& call) { run_elementwise(call); }
void join_cpu(const JoinRemainderCall& call) { run_elementwise(call); }

}  // namespace

FUSEDAMP_REGISTER_KERNEL(CPU, SplitRemainderCall, split_cpu);
FUSEDAMP_REGISTER_KERNEL(CPU, JoinRemainderCall, join_cpu);
#endif

}  // namespace fusedamp::cpu

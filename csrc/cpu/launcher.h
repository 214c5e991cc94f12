// The CPU multi-tensor launcher of the op drivers: every chunk of every tensor runs as a task on
// torch's threads, and per-tensor reductions merge the chunks' results in chunk order.
#pragma once

#include <ATen/Config.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/isa.h"
#include "fusedamp/multi_tensor_plan.h"

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "fusedamp: torch runs at::parallel_for through OpenMP; build with -fopenmp, or every CPU kernel runs on one thread"
#endif

namespace fusedamp::cpu {

// Elements per task: large enough to amortize scheduling, small enough that a few hundred
// mid-sized tensors still spread over every core.
constexpr int64_t kChunkSize = 1 << 15;

// Runs body(task_index, tensor, begin, end) for every task. Threads take tasks one at a time from
// a shared counter instead of a fixed share each: tails and small tensors make tasks uneven, and
// on a shared machine a thread that is descheduled for a while must not hold back the work it
// has not started (the running threads take it). Under two chunks of elements run inline:
// waking the other threads would cost more than it saves.
template <typename Body>
void for_each_task(const std::vector<ChunkTask>& tasks, const std::vector<int64_t>& numels,
                   Body&& body) {
  auto run = [&](int64_t k) {
    const ChunkTask& task = tasks[k];
    const int64_t begin = task.chunk * kChunkSize;
    body(k, task.tensor, begin, std::min(numels[task.tensor], begin + kChunkSize));
  };
  const int64_t count = int64_t(tasks.size());
  int64_t elements = 0;
  for (const int64_t numel : numels) elements += numel;
  if (elements < 2 * kChunkSize || at::get_num_threads() == 1) {
    for (int64_t k = 0; k < count; ++k) run(k);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t k = next.fetch_add(1); k < count; k = next.fetch_add(1)) run(k);
  });
}

// body(tensor, begin, end) for every chunk of every tensor.
template <typename Body>
void for_each_chunk(const std::vector<int64_t>& numels, Body&& body) {
  for_each_task(plan_chunks(numels, kChunkSize), numels,
                [&](int64_t, int64_t tensor, int64_t begin, int64_t end) { body(tensor, begin, end); });
}

// The per-tensor reduction: chunk(tensor, begin, end) gives each chunk's Partial (in parallel);
// result[t] = identity combined with the partials of tensor t in chunk order, so the result
// does not depend on the thread count. combine(into, part) merges part into `into`.
template <typename Partial, typename Chunk, typename Combine>
std::vector<Partial> reduce_per_tensor(const std::vector<int64_t>& numels, const Partial& identity,
                                       Chunk&& chunk, Combine&& combine) {
  const std::vector<ChunkTask> tasks = plan_chunks(numels, kChunkSize);
  std::vector<Partial> partials(tasks.size(), identity);
  for_each_task(tasks, numels, [&](int64_t k, int64_t tensor, int64_t begin, int64_t end) {
    partials[k] = chunk(tensor, begin, end);
  });
  std::vector<Partial> per_tensor(numels.size(), identity);
  for (size_t k = 0; k < tasks.size(); ++k) combine(per_tensor[tasks[k].tensor], partials[k]);
  return per_tensor;
}

// The step counts of an optimizer call (fp32 scalars), after its update.
inline void increment_steps(const std::vector<void*>& steps) {
  for (void* step : steps) *static_cast<float*>(step) += 1.0f;
}

}  // namespace fusedamp::cpu

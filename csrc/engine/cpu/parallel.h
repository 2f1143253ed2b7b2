// Parallel loops of the CPU engine, over the ParallelRunner its caller provides.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "nodrop/engine_cpu.h"

namespace nodrop::cpu {

inline int64_t num_workers(const ParallelRunner* runner) {
  return runner ? std::max<int64_t>(1, runner->num_workers()) : 1;
}

// Splits [0, n) into one contiguous block per worker (each at least min_block items) and runs
// fn(begin, end) on every block; on the calling thread when there is only one block.
template <typename Fn>
void parallel_blocks(ParallelRunner* runner, int64_t n, int64_t min_block, Fn&& fn) {
  if (n <= 0) return;
  const int64_t blocks = std::min(num_workers(runner), (n + min_block - 1) / min_block);
  if (blocks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t step = (n + blocks - 1) / blocks;
  runner->parallel_for((n + step - 1) / step, [&](int64_t b) {
    fn(b * step, std::min(n, (b + 1) * step));
  });
}

// While alive, oneDNN calls on this thread run single-threaded: the runner already provides the
// parallelism, and a second thread team on the same cores would only fight it.
class OneDnnSingleThreaded {
 public:
  explicit OneDnnSingleThreaded(bool active) : active_(active), previous_(omp_get_max_threads()) {
    if (active_) omp_set_num_threads(1);
  }
  ~OneDnnSingleThreaded() {
    if (active_) omp_set_num_threads(previous_);
  }
  OneDnnSingleThreaded(const OneDnnSingleThreaded&) = delete;
  OneDnnSingleThreaded& operator=(const OneDnnSingleThreaded&) = delete;

 private:
  bool active_;
  int previous_;
};

}  // namespace nodrop::cpu

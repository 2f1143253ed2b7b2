// The CPU engine's ParallelRunner over XLA's intra-op thread pool, which every CPU handler
// receives, so nodrop never starts a thread team that competes with XLA's.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "nodrop/engine_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace nodrop::handlers {

namespace ffi = xla::ffi;

// The calling thread takes items too, so a loop finishes even when every pool thread is busy;
// helpers that start after the last item only find the (shared, still alive) counter exhausted.
class XlaThreadPoolRunner final : public ParallelRunner {
 public:
  explicit XlaThreadPoolRunner(ffi::ThreadPool pool) : pool_(pool) {}

  int64_t num_workers() const override {
    return std::max<int64_t>(1, const_cast<ffi::ThreadPool&>(pool_).num_threads());
  }

  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) override {
    struct Loop {
      std::atomic<int64_t> next{0}, done{0};
      int64_t n = 0;
      const std::function<void(int64_t)>* fn = nullptr;
      std::mutex mu;
      std::condition_variable finished;
    };
    auto loop = std::make_shared<Loop>();
    loop->n = n;
    loop->fn = &fn;
    auto work = [](Loop& l) {
      for (int64_t i; (i = l.next.fetch_add(1)) < l.n;) {
        (*l.fn)(i);
        if (l.done.fetch_add(1) + 1 == l.n) {
          std::lock_guard<std::mutex> lock(l.mu);
          l.finished.notify_all();
        }
      }
    };
    for (int64_t h = 1; h < std::min(n, num_workers()); ++h) {
      pool_.Schedule([loop, work] { work(*loop); });
    }
    work(*loop);
    std::unique_lock<std::mutex> lock(loop->mu);
    loop->finished.wait(lock, [&] { return loop->done.load() == n; });
  }

 private:
  ffi::ThreadPool pool_;
};

}  // namespace nodrop::handlers

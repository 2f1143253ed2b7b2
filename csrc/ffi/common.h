// Shared helpers of the FFI handlers: dtype mapping, shape checks, engine Status -> ffi::Error.
//
// The JAX ops check shapes and dtypes at trace time; handlers check again because a target can
// be called directly with jax.ffi.ffi_call, and a wrong shape must never reach the engine.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "nodrop/engine.h"
#include "xla/ffi/api/ffi.h"

namespace nodrop::ffi_glue {

namespace ffi = xla::ffi;

inline std::optional<DType> float_dtype(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return DType::kFloat32;
    case ffi::DataType::F16: return DType::kFloat16;
    case ffi::DataType::BF16: return DType::kBFloat16;
    default: return std::nullopt;
  }
}

inline std::string shape_string(const ffi::AnyBuffer::Dimensions& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::Error to_ffi_error(const Status& status) {
  return status.ok() ? ffi::Error::Success() : ffi::Error::InvalidArgument(status.message());
}

// Rank check with a message naming the argument; returns an error or Success.
template <typename Buffer>
ffi::Error require_rank(const char* name, const Buffer& buffer, size_t rank) {
  if (buffer.dimensions().size() == rank) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must have rank " + std::to_string(rank) +
                                     ", got shape " + shape_string(buffer.dimensions()));
}

template <typename Buffer>
ffi::Error require_dim(const char* name, const Buffer& buffer, size_t axis, int64_t expected) {
  if (buffer.dimensions()[axis] == expected) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " has " +
                                     std::to_string(buffer.dimensions()[axis]) + " at axis " +
                                     std::to_string(axis) + " but expected " +
                                     std::to_string(expected) + " (shape " +
                                     shape_string(buffer.dimensions()) + ")");
}

// Float dtype of `buffer`, or an error naming it.
inline ffi::ErrorOr<DType> require_float(const char* name, const ffi::AnyBuffer& buffer) {
  if (auto dtype = float_dtype(buffer.element_type())) return *dtype;
  return ffi::Error::InvalidArgument(std::string(name) + " must be float32, float16 or bfloat16");
}

// The engine's ParallelRunner over XLA's intra-op thread pool. The calling thread takes items
// too, so a loop finishes even when every pool thread is busy; helpers that start after the
// last item only find the (shared, still alive) counter exhausted.
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

}  // namespace nodrop::ffi_glue

// Returns from the enclosing handler when `expr` (an ffi::Error) is a failure.
#define NODROP_RETURN_IF_ERROR(expr)               \
  do {                                             \
    ::xla::ffi::Error nodrop_error_ = (expr);      \
    if (nodrop_error_.failure()) return nodrop_error_; \
  } while (0)

// The C++ benchmarks' error handling: CHECK(expr) exits with the expression and the CUDA error
// or the engine's message when a CUDA call or an engine call fails.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "nodrop/engine.h"

namespace nodrop_bench {

inline void check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

inline void check(const nodrop::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.message().c_str());
  std::exit(1);
}

}  // namespace nodrop_bench

// Unqualified, so that a benchmark's own overloads (cuBLAS's status) take part.
#define CHECK(expr) check((expr), #expr)

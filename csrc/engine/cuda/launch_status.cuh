// The Status of the kernel launch just made: ok, or the CUDA error named after the engine call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "nodrop/engine.h"

namespace nodrop::cuda {

inline Status launch_status(const char* fn) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(fn) + ": " + cudaGetErrorString(error));
}

}  // namespace nodrop::cuda

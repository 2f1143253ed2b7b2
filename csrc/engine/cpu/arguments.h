// Argument checks shared by the CPU engine's FP8 functions: each error names the function, the
// argument and its value, as the GPU engine's do.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "nodrop/engine.h"

namespace nodrop::cpu {

struct Dim {
  const char* name;
  int64_t value;
};

struct Buffer {
  const char* name;
  const void* data;
  int64_t elements;
};

// "function: M = -1 is negative" for the first negative dimension, else "function: lhs is null"
// for the first null buffer that should hold elements.
inline Status check_arguments(const char* function, std::initializer_list<Dim> dims,
                              std::initializer_list<Buffer> buffers) {
  for (const Dim& dim : dims) {
    if (dim.value < 0) {
      return Status::Error(std::string(function) + ": " + dim.name + " = " +
                           std::to_string(dim.value) + " is negative");
    }
  }
  for (const Buffer& buffer : buffers) {
    if (buffer.elements > 0 && buffer.data == nullptr) {
      return Status::Error(std::string(function) + ": " + buffer.name + " is null");
    }
  }
  return Status::Ok();
}

}  // namespace nodrop::cpu

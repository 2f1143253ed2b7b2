// Shared helpers of the FFI handlers: dtype mapping, shape checks, engine Status -> ffi::Error.
//
// Each op family has a header (grouped_matmul.h, permute.h, router.h) that decodes and validates
// its buffers and attributes and declares its operands once, and one handler source per platform
// (<family>_cpu.cc, <family>_cuda.cc) that only calls the engine. The JAX ops check shapes and
// dtypes at trace time; handlers check again because a target can be called directly with
// jax.ffi.ffi_call, and a wrong shape must never reach the engine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "nodrop/engine.h"
#include "xla/ffi/api/ffi.h"

namespace nodrop::handlers {

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
  return ffi::Error::InvalidArgument(
      std::string(name) + " has " + std::to_string(buffer.dimensions()[axis]) + " at axis " +
      std::to_string(axis) + " but expected " + std::to_string(expected) + " (shape " +
      shape_string(buffer.dimensions()) + ")");
}

// Float dtype of `buffer`, or an error naming it.
inline ffi::ErrorOr<DType> require_float(const char* name, const ffi::AnyBuffer& buffer) {
  if (auto dtype = float_dtype(buffer.element_type())) return *dtype;
  return ffi::Error::InvalidArgument(std::string(name) + " must be float32, float16 or bfloat16");
}

inline ffi::Error require_same_dtype(const char* name, const ffi::AnyBuffer& buffer,
                                     const char* like, const ffi::AnyBuffer& reference) {
  if (buffer.element_type() == reference.element_type()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must have the dtype of " + like);
}

}  // namespace nodrop::handlers

// Returns from the enclosing handler when `expr` (an ffi::Error) is a failure.
#define NODROP_RETURN_IF_ERROR(expr)                   \
  do {                                                 \
    ::xla::ffi::Error nodrop_error_ = (expr);          \
    if (nodrop_error_.failure()) return nodrop_error_; \
  } while (0)

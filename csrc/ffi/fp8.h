// Decoding and validation of the FP8 quantisation handlers (fp8_cpu.cc, fp8_cuda.cc).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi/common.h"

namespace nodrop::handlers {

// The engine's view of one call: x [M, C] in blocks of 1 x block.
struct QuantizeCall {
  DType dtype;
  int64_t M, C, block;
};

// x [M, C] (float) -> q [M, C] float8_e4m3fn, scale [M, ceil(C / block)] float32.
// (XLA's FFI has no C++ type for FP8 elements: q is an AnyBuffer checked here.)
inline ffi::ErrorOr<QuantizeCall> decode_quantize_fp8(const ffi::AnyBuffer& x,
                                                      const ffi::AnyBuffer& q,
                                                      const ffi::Buffer<ffi::F32>& scale,
                                                      int64_t block) {
  auto dtype = require_float("x", x);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_rank("x", x, 2));
  if (block < 1) {
    return ffi::Error::InvalidArgument("block must be at least 1, got " + std::to_string(block));
  }
  const int64_t M = x.dimensions()[0], C = x.dimensions()[1];
  if (q.element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("q must be float8_e4m3fn");
  }
  NODROP_RETURN_IF_ERROR(require_rank("q", q, 2));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 0, M));
  NODROP_RETURN_IF_ERROR(require_dim("q", q, 1, C));
  NODROP_RETURN_IF_ERROR(require_rank("scale", scale, 2));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 0, M));
  NODROP_RETURN_IF_ERROR(require_dim("scale", scale, 1, (C + block - 1) / block));
  return QuantizeCall{*dtype, M, C, block};
}

// The operands after the platform's context: x -> q, scale; the attribute block.
template <typename Binding>
auto bind_quantize_fp8(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("block");
}

}  // namespace nodrop::handlers

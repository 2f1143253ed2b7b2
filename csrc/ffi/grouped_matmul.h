// Decoding and validation of the grouped matmul's handlers (grouped_matmul_cpu.cc,
// grouped_matmul_cuda.cc), and the operands they bind.
#pragma once

#include <utility>

#include "ffi/common.h"

namespace nodrop::handlers {

struct GemmShape {
  int64_t M, K, N, G;
  DType in_dtype, out_dtype;
};

// `s` with the dtypes of lhs and rhs (one float dtype) and of out (any float dtype).
inline ffi::ErrorOr<GemmShape> with_dtypes(GemmShape s, const ffi::AnyBuffer& lhs,
                                           const ffi::AnyBuffer& rhs, const ffi::AnyBuffer& out) {
  auto in_dtype = require_float("lhs", lhs);
  if (!in_dtype) return in_dtype.error();
  NODROP_RETURN_IF_ERROR(require_same_dtype("rhs", rhs, "lhs", lhs));
  auto out_dtype = require_float("out", out);
  if (!out_dtype) return out_dtype.error();
  s.in_dtype = *in_dtype;
  s.out_dtype = *out_dtype;
  return s;
}

// lhs [M, K], rhs [G, K, N] (or [G, N, K] transposed), group_sizes [G] -> out [M, N].
inline ffi::ErrorOr<GemmShape> decode_rows(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                                           const ffi::Buffer<ffi::S32>& group_sizes,
                                           const ffi::AnyBuffer& out, bool transpose_rhs) {
  NODROP_RETURN_IF_ERROR(require_rank("lhs", lhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs", rhs, 3));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  GemmShape s;
  s.M = lhs.dimensions()[0];
  s.K = lhs.dimensions()[1];
  s.G = rhs.dimensions()[0];
  s.N = rhs.dimensions()[transpose_rhs ? 1 : 2];
  NODROP_RETURN_IF_ERROR(require_dim("rhs", rhs, transpose_rhs ? 2 : 1, s.K));
  NODROP_RETURN_IF_ERROR(require_dim("group_sizes", group_sizes, 0, s.G));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 2));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.M));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 1, s.N));
  return with_dtypes(s, lhs, rhs, out);
}

// lhs [M, K], rhs [M, N], group_sizes [G] -> out [G, K, N].
inline ffi::ErrorOr<GemmShape> decode_contract(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                                               const ffi::Buffer<ffi::S32>& group_sizes,
                                               const ffi::AnyBuffer& out) {
  NODROP_RETURN_IF_ERROR(require_rank("lhs", lhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs", rhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  GemmShape s;
  s.M = lhs.dimensions()[0];
  s.K = lhs.dimensions()[1];
  s.N = rhs.dimensions()[1];
  s.G = group_sizes.dimensions()[0];
  NODROP_RETURN_IF_ERROR(require_dim("rhs", rhs, 0, s.M));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 3));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.G));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 1, s.K));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 2, s.N));
  return with_dtypes(s, lhs, rhs, out);
}

// The operands after the platform's context: lhs, rhs, group_sizes -> out; attributes
// transpose_rhs and checked. The CUDA handler returns its workspace after these.
template <typename Binding>
auto bind_grouped_matmul(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("transpose_rhs")
      .template Attr<bool>("checked");
}

// lhs, rhs, group_sizes -> out; attribute checked.
template <typename Binding>
auto bind_grouped_matmul_contract(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("checked");
}

}  // namespace nodrop::handlers

// Decoding and validation of the token-permutation handlers (permute_cpu.cc, permute_cuda.cc):
// permute (sort by expert, then copy rows), and the row movers that un-permute and the gradients
// are made of: permute_rows (weighted rows into permuted order), unpermute (the weighted sum of
// each token's rows) and gather_row_dots (the weights' gradient of both).
#pragma once

#include <string>
#include <utility>

#include "ffi/common.h"

namespace nodrop::handlers {

struct RowsShape {
  int64_t T, k, H;
  DType dtype;
};

// x [T, H], ids [T, k] -> rows [T*k, H], group_sizes [E], row_map [T*k].
inline ffi::ErrorOr<RowsShape> decode_permute(const ffi::AnyBuffer& x,
                                              const ffi::Buffer<ffi::S32>& ids,
                                              const ffi::AnyBuffer& rows,
                                              const ffi::Buffer<ffi::S32>& group_sizes,
                                              const ffi::Buffer<ffi::S32>& row_map,
                                              int64_t num_experts) {
  NODROP_RETURN_IF_ERROR(require_rank("x", x, 2));
  NODROP_RETURN_IF_ERROR(require_rank("ids", ids, 2));
  RowsShape s{x.dimensions()[0], ids.dimensions()[1], x.dimensions()[1], DType::kFloat32};
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, s.T));
  NODROP_RETURN_IF_ERROR(require_rank("rows", rows, 2));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 1, s.H));
  NODROP_RETURN_IF_ERROR(require_dim("group_sizes", group_sizes, 0, num_experts));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, s.T * s.k));
  auto dtype = require_float("x", x);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_same_dtype("rows", rows, "x", x));
  s.dtype = *dtype;
  return s;
}

// src [T, H], row_map [T*k], weights [T, k] -> dst [T*k, H].
inline ffi::ErrorOr<RowsShape> decode_permute_rows(const ffi::AnyBuffer& src,
                                                   const ffi::Buffer<ffi::S32>& row_map,
                                                   const ffi::Buffer<ffi::F32>& weights,
                                                   const ffi::AnyBuffer& dst) {
  NODROP_RETURN_IF_ERROR(require_rank("src", src, 2));
  NODROP_RETURN_IF_ERROR(require_rank("weights", weights, 2));
  RowsShape s{src.dimensions()[0], weights.dimensions()[1], src.dimensions()[1], DType::kFloat32};
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 0, s.T));
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_rank("dst", dst, 2));
  NODROP_RETURN_IF_ERROR(require_dim("dst", dst, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_dim("dst", dst, 1, s.H));
  auto dtype = require_float("src", src);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_same_dtype("dst", dst, "src", src));
  s.dtype = *dtype;
  return s;
}

// rows [T*k, H], row_map [T*k], weights [T, k] -> out [T, H].
inline ffi::ErrorOr<RowsShape> decode_unpermute(const ffi::AnyBuffer& rows,
                                                const ffi::Buffer<ffi::S32>& row_map,
                                                const ffi::Buffer<ffi::F32>& weights,
                                                const ffi::AnyBuffer& out) {
  NODROP_RETURN_IF_ERROR(require_rank("weights", weights, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rows", rows, 2));
  RowsShape s{weights.dimensions()[0], weights.dimensions()[1], rows.dimensions()[1],
              DType::kFloat32};
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 2));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.T));
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 1, s.H));
  auto dtype = require_float("rows", rows);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_same_dtype("out", out, "rows", rows));
  s.dtype = *dtype;
  return s;
}

// a [T, H], rows [T*k, H], row_map [T*k] -> out [T, k] float32.
inline ffi::ErrorOr<RowsShape> decode_row_dots(const ffi::AnyBuffer& a, const ffi::AnyBuffer& rows,
                                               const ffi::Buffer<ffi::S32>& row_map,
                                               const ffi::Buffer<ffi::F32>& out) {
  NODROP_RETURN_IF_ERROR(require_rank("a", a, 2));
  NODROP_RETURN_IF_ERROR(require_rank("out", out, 2));
  RowsShape s{a.dimensions()[0], out.dimensions()[1], a.dimensions()[1], DType::kFloat32};
  NODROP_RETURN_IF_ERROR(require_dim("out", out, 0, s.T));
  NODROP_RETURN_IF_ERROR(require_rank("rows", rows, 2));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 0, s.T * s.k));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 1, s.H));
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, s.T * s.k));
  auto dtype = require_float("a", a);
  if (!dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(require_same_dtype("rows", rows, "a", a));
  s.dtype = *dtype;
  return s;
}

// The operands after the platform's context. Permute: x, ids -> rows, group_sizes, row_map;
// attributes num_experts and checked (the CUDA handler returns its workspace after these).
template <typename Binding>
auto bind_permute(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int64_t>("num_experts")
      .template Attr<bool>("checked");
}

// permute_rows: src, row_map, weights -> dst; unpermute: rows, row_map, weights -> out.
template <typename Binding>
auto bind_row_mover(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>();
}

// a, rows, row_map -> out.
template <typename Binding>
auto bind_gather_row_dots(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace nodrop::handlers

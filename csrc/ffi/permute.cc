// FFI handlers of token permutation: permute (sort by expert + copy rows), and the row movers
// that un-permute and the gradients are made of (scatter rows, gather rows, row dot products).
#include "ffi/common.h"

namespace nodrop::ffi_glue {
namespace {

// x [T, H], ids [T, k] -> rows [T*k, H], group_sizes [E], row_map [T*k].
ffi::Error PermuteCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> rows,
                      ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                      ffi::Result<ffi::Buffer<ffi::S32>> row_map, int64_t num_experts,
                      bool checked) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("x", x, 2));
  NODROP_RETURN_IF_ERROR(require_rank("ids", ids, 2));
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1], k = ids.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_rank("rows", *rows, 2));
  NODROP_RETURN_IF_ERROR(require_dim("rows", *rows, 0, T * k));
  NODROP_RETURN_IF_ERROR(require_dim("rows", *rows, 1, H));
  NODROP_RETURN_IF_ERROR(require_dim("group_sizes", *group_sizes, 0, num_experts));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", *row_map, 0, T * k));
  auto dtype = require_float("x", x);
  if (!dtype) return dtype.error();
  if (rows->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("rows must have the dtype of x");
  }
  Status status = cpu::sort_by_expert(ids.typed_data(), T, k, num_experts, checked,
                                      row_map->typed_data(), group_sizes->typed_data());
  if (!status.ok()) return to_ffi_error(status);
  cpu::scatter_rows(x.untyped_data(), *dtype, row_map->typed_data(), nullptr, T, k, H,
                    rows->untyped_data(), &runner);
  return ffi::Error::Success();
}

// src [T, H], row_map [T*k], weights [T, k] -> dst [T*k, H].
ffi::Error ScatterRowsCpu(ffi::ThreadPool pool, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> row_map,
                          ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> dst) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("src", src, 2));
  NODROP_RETURN_IF_ERROR(require_rank("weights", weights, 2));
  const int64_t T = src.dimensions()[0], H = src.dimensions()[1], k = weights.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, T * k));
  NODROP_RETURN_IF_ERROR(require_rank("dst", *dst, 2));
  NODROP_RETURN_IF_ERROR(require_dim("dst", *dst, 0, T * k));
  NODROP_RETURN_IF_ERROR(require_dim("dst", *dst, 1, H));
  auto dtype = require_float("src", src);
  if (!dtype) return dtype.error();
  if (dst->element_type() != src.element_type()) {
    return ffi::Error::InvalidArgument("dst must have the dtype of src");
  }
  cpu::scatter_rows(src.untyped_data(), *dtype, row_map.typed_data(), weights.typed_data(), T, k,
                    H, dst->untyped_data(), &runner);
  return ffi::Error::Success();
}

// rows [T*k, H], row_map [T*k], weights [T, k] -> out [T, H].
ffi::Error GatherRowsCpu(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                         ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("weights", weights, 2));
  const int64_t T = weights.dimensions()[0], k = weights.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("rows", rows, 2));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 0, T * k));
  const int64_t H = rows.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, T * k));
  NODROP_RETURN_IF_ERROR(require_rank("out", *out, 2));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 1, H));
  auto dtype = require_float("rows", rows);
  if (!dtype) return dtype.error();
  if (out->element_type() != rows.element_type()) {
    return ffi::Error::InvalidArgument("out must have the dtype of rows");
  }
  cpu::gather_rows(rows.untyped_data(), *dtype, row_map.typed_data(), weights.typed_data(), T, k,
                   H, out->untyped_data(), &runner);
  return ffi::Error::Success();
}

// a [T, H], rows [T*k, H], row_map [T*k] -> out [T, k] float32.
ffi::Error GatherRowDotsCpu(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("a", a, 2));
  NODROP_RETURN_IF_ERROR(require_rank("out", *out, 2));
  const int64_t T = a.dimensions()[0], H = a.dimensions()[1], k = out->dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 0, T));
  NODROP_RETURN_IF_ERROR(require_rank("rows", rows, 2));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 0, T * k));
  NODROP_RETURN_IF_ERROR(require_dim("rows", rows, 1, H));
  NODROP_RETURN_IF_ERROR(require_rank("row_map", row_map, 1));
  NODROP_RETURN_IF_ERROR(require_dim("row_map", row_map, 0, T * k));
  auto dtype = require_float("a", a);
  if (!dtype) return dtype.error();
  if (rows.element_type() != a.element_type()) {
    return ffi::Error::InvalidArgument("rows must have the dtype of a");
  }
  cpu::gather_row_dots(a.untyped_data(), rows.untyped_data(), *dtype, row_map.typed_data(), T, k,
                       H, out->typed_data(), &runner);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nodrop::ffi_glue

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteCpu, nodrop::ffi_glue::PermuteCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<bool>("checked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropScatterRowsCpu, nodrop::ffi_glue::ScatterRowsCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowsCpu, nodrop::ffi_glue::GatherRowsCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowDotsCpu, nodrop::ffi_glue::GatherRowDotsCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

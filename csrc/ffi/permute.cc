// FFI handlers of token permutation: permute (sort by expert + copy rows), and the row movers
// that un-permute and the gradients are made of (scatter rows, gather rows, row dot products).
// Compiled once for the CPU library and, with NODROP_WITH_CUDA, once for the CUDA library.
#include "ffi/common.h"

#ifdef NODROP_WITH_CUDA
#include "nodrop/engine_cuda_moe.h"
#endif

namespace nodrop::ffi_glue {
namespace {

struct RowsShape {
  int64_t T, k, H;
  DType dtype;
};

ffi::Error require_same_dtype(const char* name, const ffi::AnyBuffer& buffer, const char* like,
                              const ffi::AnyBuffer& reference) {
  if (buffer.element_type() == reference.element_type()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must have the dtype of " + like);
}

// x [T, H], ids [T, k] -> rows [T*k, H], group_sizes [E], row_map [T*k].
ffi::ErrorOr<RowsShape> decode_permute(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& ids,
                                       const ffi::AnyBuffer& rows,
                                       const ffi::Buffer<ffi::S32>& group_sizes,
                                       const ffi::Buffer<ffi::S32>& row_map, int64_t num_experts) {
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
ffi::ErrorOr<RowsShape> decode_scatter(const ffi::AnyBuffer& src,
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
ffi::ErrorOr<RowsShape> decode_gather(const ffi::AnyBuffer& rows,
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
ffi::ErrorOr<RowsShape> decode_row_dots(const ffi::AnyBuffer& a, const ffi::AnyBuffer& rows,
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

#ifndef NODROP_WITH_CUDA

ffi::Error Permute(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                   ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                   ffi::Result<ffi::Buffer<ffi::S32>> row_map, int64_t num_experts, bool checked) {
  auto s = decode_permute(x, ids, *rows, *group_sizes, *row_map, num_experts);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  Status status = cpu::sort_by_expert(ids.typed_data(), s->T, s->k, num_experts, checked,
                                      row_map->typed_data(), group_sizes->typed_data());
  if (!status.ok()) return to_ffi_error(status);
  cpu::scatter_rows(x.untyped_data(), s->dtype, row_map->typed_data(), nullptr, s->T, s->k, s->H,
                    rows->untyped_data(), &runner);
  return ffi::Error::Success();
}

ffi::Error ScatterRows(ffi::ThreadPool pool, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> row_map,
                       ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> dst) {
  auto s = decode_scatter(src, row_map, weights, *dst);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  cpu::scatter_rows(src.untyped_data(), s->dtype, row_map.typed_data(), weights.typed_data(), s->T,
                    s->k, s->H, dst->untyped_data(), &runner);
  return ffi::Error::Success();
}

ffi::Error GatherRows(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                      ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto s = decode_gather(rows, row_map, weights, *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  cpu::gather_rows(rows.untyped_data(), s->dtype, row_map.typed_data(), weights.typed_data(), s->T,
                   s->k, s->H, out->untyped_data(), &runner);
  return ffi::Error::Success();
}

ffi::Error GatherRowDots(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer rows,
                         ffi::Buffer<ffi::S32> row_map, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto s = decode_row_dots(a, rows, row_map, *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  cpu::gather_row_dots(a.untyped_data(), rows.untyped_data(), s->dtype, row_map.typed_data(), s->T,
                       s->k, s->H, out->typed_data(), &runner);
  return ffi::Error::Success();
}

#else  // NODROP_WITH_CUDA

ffi::Error Permute(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                   ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                   ffi::Result<ffi::Buffer<ffi::S32>> row_map, ffi::Result<ffi::AnyBuffer> workspace,
                   int64_t num_experts, bool checked) {
  (void)checked;  // the CUDA engine always clamps: checking would need a host read
  auto s = decode_permute(x, ids, *rows, *group_sizes, *row_map, num_experts);
  if (!s) return s.error();
  Status status = cuda::sort_by_expert(ids.typed_data(), s->T, s->k, num_experts,
                                       row_map->typed_data(), group_sizes->typed_data(),
                                       workspace->untyped_data(), workspace->size_bytes(), stream);
  if (!status.ok()) return to_ffi_error(status);
  return to_ffi_error(cuda::scatter_rows(x.untyped_data(), s->dtype, row_map->typed_data(), nullptr,
                                         s->T, s->k, s->H, rows->untyped_data(), stream));
}

ffi::Error ScatterRows(cudaStream_t stream, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> row_map,
                       ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> dst) {
  auto s = decode_scatter(src, row_map, weights, *dst);
  if (!s) return s.error();
  return to_ffi_error(cuda::scatter_rows(src.untyped_data(), s->dtype, row_map.typed_data(),
                                         weights.typed_data(), s->T, s->k, s->H,
                                         dst->untyped_data(), stream));
}

ffi::Error GatherRows(cudaStream_t stream, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                      ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto s = decode_gather(rows, row_map, weights, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::gather_rows(rows.untyped_data(), s->dtype, row_map.typed_data(),
                                        weights.typed_data(), s->T, s->k, s->H,
                                        out->untyped_data(), stream));
}

ffi::Error GatherRowDots(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer rows,
                         ffi::Buffer<ffi::S32> row_map, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto s = decode_row_dots(a, rows, row_map, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::gather_row_dots(a.untyped_data(), rows.untyped_data(), s->dtype,
                                            row_map.typed_data(), s->T, s->k, s->H,
                                            out->typed_data(), stream));
}

#endif

}  // namespace
}  // namespace nodrop::ffi_glue

namespace ffi = xla::ffi;

#ifndef NODROP_WITH_CUDA

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteCpu, nodrop::ffi_glue::Permute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<bool>("checked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropScatterRowsCpu, nodrop::ffi_glue::ScatterRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowsCpu, nodrop::ffi_glue::GatherRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowDotsCpu, nodrop::ffi_glue::GatherRowDots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#else  // the CUDA handlers also return the sort's workspace; all are graph-safe

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteCuda, nodrop::ffi_glue::Permute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<bool>("checked"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropScatterRowsCuda, nodrop::ffi_glue::ScatterRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowsCuda, nodrop::ffi_glue::GatherRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowDotsCuda, nodrop::ffi_glue::GatherRowDots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

#endif

// FFI handlers of the grouped matmul (ragged rows) and its ragged contraction (weight gradient).
#include "ffi/common.h"

namespace nodrop::ffi_glue {
namespace {

// lhs [M, K], rhs [G, K, N] (or [G, N, K] transposed), group_sizes [G] -> out [M, N].
ffi::Error GroupedMatmulCpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs, bool checked) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("lhs", lhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs", rhs, 3));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  const int64_t M = lhs.dimensions()[0], K = lhs.dimensions()[1], G = rhs.dimensions()[0];
  const int64_t N = rhs.dimensions()[transpose_rhs ? 1 : 2];
  NODROP_RETURN_IF_ERROR(require_dim("rhs", rhs, transpose_rhs ? 2 : 1, K));
  NODROP_RETURN_IF_ERROR(require_dim("group_sizes", group_sizes, 0, G));
  NODROP_RETURN_IF_ERROR(require_rank("out", *out, 2));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 0, M));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 1, N));
  auto in_dtype = require_float("lhs", lhs);
  if (!in_dtype) return in_dtype.error();
  if (rhs.element_type() != lhs.element_type()) {
    return ffi::Error::InvalidArgument("rhs must have the dtype of lhs");
  }
  auto out_dtype = require_float("out", *out);
  if (!out_dtype) return out_dtype.error();
  return to_ffi_error(cpu::grouped_matmul(lhs.untyped_data(), rhs.untyped_data(), *in_dtype,
                                          group_sizes.typed_data(), M, K, N, G, transpose_rhs,
                                          out->untyped_data(), *out_dtype, checked, &runner));
}

// lhs [M, K], rhs [M, N], group_sizes [G] -> out [G, K, N].
ffi::Error GroupedMatmulContractCpu(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Result<ffi::AnyBuffer> out, bool checked) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("lhs", lhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("rhs", rhs, 2));
  NODROP_RETURN_IF_ERROR(require_rank("group_sizes", group_sizes, 1));
  const int64_t M = lhs.dimensions()[0], K = lhs.dimensions()[1], N = rhs.dimensions()[1];
  const int64_t G = group_sizes.dimensions()[0];
  NODROP_RETURN_IF_ERROR(require_dim("rhs", rhs, 0, M));
  NODROP_RETURN_IF_ERROR(require_rank("out", *out, 3));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 0, G));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 1, K));
  NODROP_RETURN_IF_ERROR(require_dim("out", *out, 2, N));
  auto in_dtype = require_float("lhs", lhs);
  if (!in_dtype) return in_dtype.error();
  if (rhs.element_type() != lhs.element_type()) {
    return ffi::Error::InvalidArgument("rhs must have the dtype of lhs");
  }
  auto out_dtype = require_float("out", *out);
  if (!out_dtype) return out_dtype.error();
  return to_ffi_error(cpu::grouped_matmul_contract(lhs.untyped_data(), rhs.untyped_data(),
                                                   *in_dtype, group_sizes.typed_data(), M, K, N, G,
                                                   out->untyped_data(), *out_dtype, checked, &runner));
}

}  // namespace
}  // namespace nodrop::ffi_glue

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulCpu, nodrop::ffi_glue::GroupedMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<bool>("checked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulContractCpu,
                              nodrop::ffi_glue::GroupedMatmulContractCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("checked"));

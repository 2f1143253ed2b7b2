// FFI handlers of the grouped matmul (ragged rows) and its ragged contraction (weight gradient).
// Compiled once for the CPU library and, with NODROP_WITH_CUDA, once more for the CUDA library:
// both share the decoding and checks, and differ only in the engine they call.
#include "ffi/common.h"

#ifdef NODROP_WITH_CUDA
#include "nodrop/engine_cuda.h"
#endif

namespace nodrop::ffi_glue {
namespace {

struct GemmShape {
  int64_t M, K, N, G;
  DType in_dtype, out_dtype;
};

ffi::ErrorOr<DType> same_float_dtype(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs) {
  auto dtype = require_float("lhs", lhs);
  if (!dtype) return dtype.error();
  if (rhs.element_type() != lhs.element_type()) {
    return ffi::Error::InvalidArgument("rhs must have the dtype of lhs");
  }
  return *dtype;
}

// lhs [M, K], rhs [G, K, N] (or [G, N, K] transposed), group_sizes [G] -> out [M, N].
ffi::ErrorOr<GemmShape> decode_rows(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
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
  auto in_dtype = same_float_dtype(lhs, rhs);
  if (!in_dtype) return in_dtype.error();
  auto out_dtype = require_float("out", out);
  if (!out_dtype) return out_dtype.error();
  s.in_dtype = *in_dtype;
  s.out_dtype = *out_dtype;
  return s;
}

// lhs [M, K], rhs [M, N], group_sizes [G] -> out [G, K, N].
ffi::ErrorOr<GemmShape> decode_contract(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
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
  auto in_dtype = same_float_dtype(lhs, rhs);
  if (!in_dtype) return in_dtype.error();
  auto out_dtype = require_float("out", out);
  if (!out_dtype) return out_dtype.error();
  s.in_dtype = *in_dtype;
  s.out_dtype = *out_dtype;
  return s;
}

#ifndef NODROP_WITH_CUDA

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                         bool transpose_rhs, bool checked) {
  auto s = decode_rows(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul(lhs.untyped_data(), rhs.untyped_data(), s->in_dtype,
                                          group_sizes.typed_data(), s->M, s->K, s->N, s->G,
                                          transpose_rhs, out->untyped_data(), s->out_dtype,
                                          checked, &runner));
}

ffi::Error GroupedMatmulContract(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> out, bool checked) {
  auto s = decode_contract(lhs, rhs, group_sizes, *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_contract(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, out->untyped_data(), s->out_dtype, checked, &runner));
}

#else  // NODROP_WITH_CUDA: group sizes stay on the device; the workspace is an extra result.

ffi::Error GroupedMatmul(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> workspace, bool transpose_rhs, bool checked) {
  (void)checked;  // the CUDA engine always clamps: checking would need a host read
  auto s = decode_rows(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, transpose_rhs, out->untyped_data(), s->out_dtype, workspace->untyped_data(),
      workspace->size_bytes(), stream));
}

ffi::Error GroupedMatmulContract(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace, bool checked) {
  (void)checked;
  auto s = decode_contract(lhs, rhs, group_sizes, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_contract(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, out->untyped_data(), s->out_dtype, workspace->untyped_data(),
      workspace->size_bytes(), stream));
}

#endif

}  // namespace
}  // namespace nodrop::ffi_glue

namespace ffi = xla::ffi;

#ifndef NODROP_WITH_CUDA

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulCpu, nodrop::ffi_glue::GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<bool>("checked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulContractCpu,
                              nodrop::ffi_glue::GroupedMatmulContract,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("checked"));

#else

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulCuda, nodrop::ffi_glue::GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs")
                                  .Attr<bool>("checked"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulContractCuda,
                              nodrop::ffi_glue::GroupedMatmulContract,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("checked"),
                              {ffi::Traits::kCmdBufferCompatible});

#endif

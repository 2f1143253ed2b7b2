// The FP8 handlers on the CUDA engine; CUDA-graph compatible. Group sizes stay on the device;
// the four grouped matmuls' workspace is an extra result sized by
// NodropGroupedMatmulFp8BlockwiseWorkspaceBytes, permute_fp8's sort's by
// NodropSortByExpertWorkspaceBytes (permute_cuda.cc).
#include "ffi/fp8.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::handlers {
namespace {

ffi::Error QuantizeFp8(cudaStream_t stream, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t block) {
  auto call = decode_quantize_fp8(x, *q, *scale, block);
  if (!call) return call.error();
  return to_ffi_error(cuda::quantize_fp8(x.untyped_data(), call->dtype, call->M, call->C,
                                         call->block,
                                         static_cast<uint8_t*>(q->untyped_data()),
                                         scale->typed_data(), stream));
}

// `checked` is accepted and ignored here and below: the CUDA engine always clamps (checking needs
// a host read).
ffi::Error PermuteFp8(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> given_scale, ffi::Result<ffi::AnyBuffer> rows,
                      ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                      ffi::Result<ffi::Buffer<ffi::S32>> row_map, ffi::Result<ffi::AnyBuffer> q,
                      ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t num_experts,
                      bool /*checked*/, ffi::Result<ffi::AnyBuffer> workspace) {
  auto call = decode_permute_fp8(x, ids, given_scale, *rows, *group_sizes, *row_map, *q, *scale,
                                 num_experts);
  if (!call) return call.error();
  const RowsShape& s = call->shape;
  Status status = cuda::sort_by_expert(ids.typed_data(), s.T, s.k, num_experts,
                                       row_map->typed_data(), group_sizes->typed_data(),
                                       workspace->untyped_data(), workspace->size_bytes(), stream);
  if (!status.ok()) return to_ffi_error(status);
  return to_ffi_error(cuda::permute_rows_fp8(
      x.untyped_data(), s.dtype, row_map->typed_data(), s.T, s.k, s.H, call->given_scale,
      rows->untyped_data(), static_cast<uint8_t*>(q->untyped_data()), scale->typed_data(),
      stream));
}

ffi::Error QuantizeFp8Transposed(cudaStream_t stream, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Buffer<ffi::F32> given_scale,
                                 ffi::Result<ffi::AnyBuffer> q_t,
                                 ffi::Result<ffi::Buffer<ffi::F32>> scale, bool /*checked*/) {
  auto call = decode_quantize_fp8_transposed(x, group_sizes, given_scale, *q_t, *scale);
  if (!call) return call.error();
  return to_ffi_error(cuda::quantize_fp8_transposed(
      x.untyped_data(), call->dtype, group_sizes.typed_data(), call->M, call->C, call->G,
      call->given_scale, static_cast<uint8_t*>(q_t->untyped_data()), scale->typed_data(), stream));
}

ffi::Error TransposeFp8Codes(cudaStream_t stream, ffi::AnyBuffer q,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q_t,
                             bool /*checked*/) {
  auto call = decode_transpose_fp8_codes(q, group_sizes, *q_t);
  if (!call) return call.error();
  return to_ffi_error(cuda::transpose_fp8_codes(
      static_cast<const uint8_t*>(q.untyped_data()), group_sizes.typed_data(), call->M, call->C,
      call->G, static_cast<uint8_t*>(q_t->untyped_data()), stream));
}

// quantize_fp8_weights, or with `transposed` quantize_fp8_weights_transposed.
template <bool transposed>
ffi::Error QuantizeFp8Weights(cudaStream_t stream, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> given_scale, ffi::Result<ffi::AnyBuffer> q,
                              ffi::Result<ffi::Buffer<ffi::F32>> scale) {
  auto call = decode_quantize_fp8_weights(w, given_scale, *q, *scale, transposed);
  if (!call) return call.error();
  auto quantize = transposed ? cuda::quantize_fp8_weights_transposed : cuda::quantize_fp8_weights;
  return to_ffi_error(quantize(w.untyped_data(), call->dtype, call->G, call->K, call->N,
                               call->given_scale, static_cast<uint8_t*>(q->untyped_data()),
                               scale->typed_data(), stream));
}

ffi::Error GroupedMatmulFp8Blockwise(cudaStream_t stream, ffi::AnyBuffer lhs,
                                     ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                                     ffi::Buffer<ffi::F32> rhs_scales,
                                     ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::Result<ffi::Buffer<ffi::BF16>> out, bool /*checked*/,
                                     ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_grouped_matmul_fp8_blockwise(lhs, lhs_scales, rhs, rhs_scales, group_sizes,
                                               *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_fp8_blockwise(
      lhs.untyped_data(), lhs_scales.typed_data(), rhs.untyped_data(), rhs_scales.typed_data(),
      group_sizes.typed_data(), s->M, s->K, s->N, s->G, out->untyped_data(),
      workspace->untyped_data(), workspace->size_bytes(), stream));
}

ffi::Error GroupedMatmulFp8Tensorwise(cudaStream_t stream, ffi::AnyBuffer lhs,
                                      ffi::Buffer<ffi::F32> lhs_scale, ffi::AnyBuffer rhs,
                                      ffi::Buffer<ffi::F32> rhs_scales,
                                      ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::Result<ffi::Buffer<ffi::BF16>> out, bool /*checked*/,
                                      bool fast_accumulation,
                                      ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_grouped_matmul_fp8_tensorwise(lhs, lhs_scale, rhs, rhs_scales, group_sizes,
                                                *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_fp8_tensorwise(
      lhs.untyped_data(), lhs_scale.typed_data(), rhs.untyped_data(), rhs_scales.typed_data(),
      group_sizes.typed_data(), s->M, s->K, s->N, s->G, fast_accumulation, out->untyped_data(),
      workspace->untyped_data(), workspace->size_bytes(), stream));
}

ffi::Error GroupedMatmulFp8BlockwiseContract(cudaStream_t stream, ffi::AnyBuffer lhs_t,
                                             ffi::Buffer<ffi::F32> lhs_scales,
                                             ffi::AnyBuffer rhs_t,
                                             ffi::Buffer<ffi::F32> rhs_scales,
                                             ffi::Buffer<ffi::S32> group_sizes,
                                             ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                             int64_t num_rows, bool /*checked*/,
                                             ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_grouped_matmul_fp8_blockwise_contract(lhs_t, lhs_scales, rhs_t, rhs_scales,
                                                        group_sizes, *out, num_rows);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_fp8_blockwise_contract(
      lhs_t.untyped_data(), lhs_scales.typed_data(), rhs_t.untyped_data(),
      rhs_scales.typed_data(), group_sizes.typed_data(), s->M, s->K, s->N, s->G,
      out->untyped_data(), workspace->untyped_data(), workspace->size_bytes(), stream));
}

ffi::Error GroupedMatmulFp8TensorwiseContract(cudaStream_t stream, ffi::AnyBuffer lhs_t,
                                              ffi::Buffer<ffi::F32> lhs_scale,
                                              ffi::AnyBuffer rhs_t,
                                              ffi::Buffer<ffi::F32> rhs_scale,
                                              ffi::Buffer<ffi::S32> group_sizes,
                                              ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                              int64_t num_rows, bool /*checked*/,
                                              bool fast_accumulation,
                                              ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_grouped_matmul_fp8_tensorwise_contract(lhs_t, lhs_scale, rhs_t, rhs_scale,
                                                         group_sizes, *out, num_rows);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_fp8_tensorwise_contract(
      lhs_t.untyped_data(), lhs_scale.typed_data(), rhs_t.untyped_data(), rhs_scale.typed_data(),
      group_sizes.typed_data(), s->M, s->K, s->N, s->G, fast_accumulation, out->untyped_data(),
      workspace->untyped_data(), workspace->size_bytes(), stream));
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8Cuda, QuantizeFp8,
                              bind_quantize_fp8(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8BlockwiseCuda, GroupedMatmulFp8Blockwise,
    bind_grouped_matmul_fp8_blockwise(ffi::Ffi::Bind().Ctx<Stream>())
        .Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8TensorwiseCuda, GroupedMatmulFp8Tensorwise,
    bind_grouped_matmul_fp8_tensorwise(ffi::Ffi::Bind().Ctx<Stream>())
        .Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropPermuteFp8Cuda, PermuteFp8,
    bind_permute_fp8(ffi::Ffi::Bind().Ctx<Stream>()).Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8TransposedCuda, QuantizeFp8Transposed,
                              bind_quantize_fp8_transposed(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTransposeFp8CodesCuda, TransposeFp8Codes,
                              bind_transpose_fp8_codes(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8WeightsCuda, QuantizeFp8Weights<false>,
                              bind_quantize_fp8_weights(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8WeightsTransposedCuda, QuantizeFp8Weights<true>,
                              bind_quantize_fp8_weights(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8BlockwiseContractCuda, GroupedMatmulFp8BlockwiseContract,
    bind_grouped_matmul_fp8_blockwise_contract(ffi::Ffi::Bind().Ctx<Stream>())
        .Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8TensorwiseContractCuda, GroupedMatmulFp8TensorwiseContract,
    bind_grouped_matmul_fp8_tensorwise_contract(ffi::Ffi::Bind().Ctx<Stream>())
        .Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

// The workspace size, for the JAX op, which allocates it as an extra result of the custom call.
extern "C" int64_t NodropGroupedMatmulFp8BlockwiseWorkspaceBytes(int64_t num_groups) {
  return static_cast<int64_t>(nodrop::cuda::grouped_matmul_fp8_blockwise_workspace_bytes(num_groups));
}

}  // namespace nodrop::handlers

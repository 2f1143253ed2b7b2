// The token-permutation CUDA handlers: expert ids are read only on the device, the sort's
// workspace is an extra result of permute (NodropSortByExpertWorkspaceBytes), and all are
// CUDA-graph compatible. `checked` is ignored: the CUDA engine always drops out-of-range ids.
#include <cstdint>

#include "ffi/permute.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::handlers {
namespace {

ffi::Error Permute(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                   ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                   ffi::Result<ffi::Buffer<ffi::S32>> row_map, int64_t num_experts,
                   bool /*checked*/, ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_permute(x, ids, *rows, *group_sizes, *row_map, num_experts);
  if (!s) return s.error();
  Status status = cuda::sort_by_expert(ids.typed_data(), s->T, s->k, num_experts,
                                       row_map->typed_data(), group_sizes->typed_data(),
                                       workspace->untyped_data(), workspace->size_bytes(), stream);
  if (!status.ok()) return to_ffi_error(status);
  return to_ffi_error(cuda::permute_rows(x.untyped_data(), s->dtype, row_map->typed_data(), nullptr,
                                         s->T, s->k, s->H, rows->untyped_data(), stream));
}

ffi::Error PermuteRows(cudaStream_t stream, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> row_map,
                       ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> dst) {
  auto s = decode_permute_rows(src, row_map, weights, *dst);
  if (!s) return s.error();
  return to_ffi_error(cuda::permute_rows(src.untyped_data(), s->dtype, row_map.typed_data(),
                                         weights.typed_data(), s->T, s->k, s->H,
                                         dst->untyped_data(), stream));
}

ffi::Error Unpermute(cudaStream_t stream, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                     ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto s = decode_unpermute(rows, row_map, weights, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::unpermute(rows.untyped_data(), s->dtype, row_map.typed_data(),
                                      weights.typed_data(), s->T, s->k, s->H, out->untyped_data(),
                                      stream));
}

ffi::Error GatherRowDots(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer rows,
                         ffi::Buffer<ffi::S32> row_map, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto s = decode_row_dots(a, rows, row_map, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::gather_row_dots(a.untyped_data(), rows.untyped_data(), s->dtype,
                                            row_map.typed_data(), s->T, s->k, s->H,
                                            out->typed_data(), stream));
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropPermuteCuda, Permute,
    bind_permute(ffi::Ffi::Bind().Ctx<Stream>()).Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteRowsCuda, PermuteRows,
                              bind_row_mover(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropUnpermuteCuda, Unpermute,
                              bind_row_mover(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowDotsCuda, GatherRowDots,
                              bind_gather_row_dots(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

// The sort's workspace size, for the JAX op, which allocates it as an extra result.
extern "C" int64_t NodropSortByExpertWorkspaceBytes(int64_t num_tokens, int64_t k,
                                                    int64_t num_experts) {
  return static_cast<int64_t>(
      nodrop::cuda::sort_by_expert_workspace_bytes(num_tokens, k, num_experts));
}

}  // namespace nodrop::handlers

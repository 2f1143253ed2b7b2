// The grouped matmul's CUDA handlers: group sizes stay on the device, the workspace is an extra
// result sized by NodropGroupedMatmulWorkspaceBytes, and both are CUDA-graph compatible.
#include <cstdint>

#include "ffi/grouped_matmul.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::handlers {
namespace {

// `checked` is accepted and ignored: the CUDA engine always clamps (checking needs a host read).
ffi::Error GroupedMatmul(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                         bool transpose_rhs, bool /*checked*/,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_rows(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, transpose_rhs, out->untyped_data(), s->out_dtype, workspace->untyped_data(),
      workspace->size_bytes(), stream));
}

ffi::Error GroupedMatmulContract(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                                 bool /*checked*/, ffi::Result<ffi::AnyBuffer> workspace) {
  auto s = decode_contract(lhs, rhs, group_sizes, *out);
  if (!s) return s.error();
  return to_ffi_error(cuda::grouped_matmul_contract(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, out->untyped_data(), s->out_dtype, workspace->untyped_data(),
      workspace->size_bytes(), stream));
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulCuda, GroupedMatmul,
    bind_grouped_matmul(ffi::Ffi::Bind().Ctx<Stream>()).Ret<ffi::AnyBuffer>(),  // workspace
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulContractCuda,
                              GroupedMatmulContract,
                              bind_grouped_matmul_contract(ffi::Ffi::Bind().Ctx<Stream>())
                                  .Ret<ffi::AnyBuffer>(),  // workspace
                              {ffi::Traits::kCmdBufferCompatible});

// The workspace size, for the JAX op, which allocates it as an extra result of the custom call
// (sized from static shapes, so no per-call cudaMalloc).
extern "C" int64_t NodropGroupedMatmulWorkspaceBytes(int64_t num_groups) {
  return static_cast<int64_t>(nodrop::cuda::grouped_matmul_workspace_bytes(num_groups));
}

}  // namespace nodrop::handlers

// The grouped matmul's CPU handlers: the engine's oneDNN GEMMs on XLA's thread pool.
#include "ffi/grouped_matmul.h"
#include "ffi/xla_thread_pool.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::handlers {
namespace {

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                         bool transpose_rhs, bool checked) {
  auto s = decode_rows(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, transpose_rhs, out->untyped_data(), s->out_dtype, checked, &runner));
}

ffi::Error GroupedMatmulContract(ffi::ThreadPool pool, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                                 bool checked) {
  auto s = decode_contract(lhs, rhs, group_sizes, *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_contract(
      lhs.untyped_data(), rhs.untyped_data(), s->in_dtype, group_sizes.typed_data(), s->M, s->K,
      s->N, s->G, out->untyped_data(), s->out_dtype, checked, &runner));
}

}  // namespace


XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGroupedMatmulCpu, GroupedMatmul,
                              bind_grouped_matmul(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulContractCpu, GroupedMatmulContract,
    bind_grouped_matmul_contract(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers

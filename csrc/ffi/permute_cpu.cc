// The token-permutation CPU handlers, on XLA's thread pool.
#include "ffi/permute.h"
#include "ffi/xla_thread_pool.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::handlers {
namespace {

ffi::Error Permute(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                   ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                   ffi::Result<ffi::Buffer<ffi::S32>> row_map, int64_t num_experts, bool checked) {
  auto s = decode_permute(x, ids, *rows, *group_sizes, *row_map, num_experts);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  Status status = cpu::sort_by_expert(ids.typed_data(), s->T, s->k, num_experts, checked,
                                      row_map->typed_data(), group_sizes->typed_data());
  if (!status.ok()) return to_ffi_error(status);
  cpu::permute_rows(x.untyped_data(), s->dtype, row_map->typed_data(), nullptr, s->T, s->k, s->H,
                    rows->untyped_data(), &runner);
  return ffi::Error::Success();
}

ffi::Error PermuteRows(ffi::ThreadPool pool, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> row_map,
                       ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> dst) {
  auto s = decode_permute_rows(src, row_map, weights, *dst);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  cpu::permute_rows(src.untyped_data(), s->dtype, row_map.typed_data(), weights.typed_data(), s->T,
                    s->k, s->H, dst->untyped_data(), &runner);
  return ffi::Error::Success();
}

ffi::Error Unpermute(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> row_map,
                     ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto s = decode_unpermute(rows, row_map, weights, *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  cpu::unpermute(rows.untyped_data(), s->dtype, row_map.typed_data(), weights.typed_data(), s->T,
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

}  // namespace


XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteCpu, Permute,
                              bind_permute(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteRowsCpu, PermuteRows,
                              bind_row_mover(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropUnpermuteCpu, Unpermute,
                              bind_row_mover(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropGatherRowDotsCpu, GatherRowDots,
                              bind_gather_row_dots(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers

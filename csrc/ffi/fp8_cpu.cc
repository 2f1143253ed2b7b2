// The FP8 handlers on the CPU engine, on XLA's thread pool.
#include "ffi/fp8.h"
#include "ffi/xla_thread_pool.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::handlers {
namespace {

ffi::Error QuantizeFp8(ffi::ThreadPool pool, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> q,
                       ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t block) {
  auto call = decode_quantize_fp8(x, *q, *scale, block);
  if (!call) return call.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::quantize_fp8(x.untyped_data(), call->dtype, call->M, call->C,
                                        call->block,
                                        static_cast<uint8_t*>(q->untyped_data()),
                                        scale->typed_data(), &runner));
}

ffi::Error PermuteFp8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> given_scale, ffi::Result<ffi::AnyBuffer> rows,
                      ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                      ffi::Result<ffi::Buffer<ffi::S32>> row_map, ffi::Result<ffi::AnyBuffer> q,
                      ffi::Result<ffi::Buffer<ffi::F32>> scale, int64_t num_experts,
                      bool checked) {
  auto call = decode_permute_fp8(x, ids, given_scale, *rows, *group_sizes, *row_map, *q, *scale,
                                 num_experts);
  if (!call) return call.error();
  const RowsShape& s = call->shape;
  XlaThreadPoolRunner runner(pool);
  Status status = cpu::sort_by_expert(ids.typed_data(), s.T, s.k, num_experts, checked,
                                      row_map->typed_data(), group_sizes->typed_data());
  if (!status.ok()) return to_ffi_error(status);
  return to_ffi_error(cpu::permute_rows_fp8(
      x.untyped_data(), s.dtype, row_map->typed_data(), s.T, s.k, s.H, call->given_scale,
      rows->untyped_data(), static_cast<uint8_t*>(q->untyped_data()), scale->typed_data(),
      &runner));
}

// quantize_fp8_weights, or with `transposed` quantize_fp8_weights_transposed.
template <bool transposed>
ffi::Error QuantizeFp8Weights(ffi::ThreadPool pool, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> given_scale, ffi::Result<ffi::AnyBuffer> q,
                              ffi::Result<ffi::Buffer<ffi::F32>> scale) {
  auto call = decode_quantize_fp8_weights(w, given_scale, *q, *scale, transposed);
  if (!call) return call.error();
  XlaThreadPoolRunner runner(pool);
  auto quantize = transposed ? cpu::quantize_fp8_weights_transposed : cpu::quantize_fp8_weights;
  return to_ffi_error(quantize(w.untyped_data(), call->dtype, call->G, call->K, call->N,
                               call->given_scale, static_cast<uint8_t*>(q->untyped_data()),
                               scale->typed_data(), &runner));
}

ffi::Error GroupedMatmulFp8Blockwise(ffi::ThreadPool pool, ffi::AnyBuffer lhs,
                                     ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                                     ffi::Buffer<ffi::F32> rhs_scales,
                                     ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::Result<ffi::Buffer<ffi::BF16>> out, bool checked) {
  auto s = decode_grouped_matmul_fp8_blockwise(lhs, lhs_scales, rhs, rhs_scales, group_sizes,
                                               *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_fp8_blockwise(
      lhs.untyped_data(), lhs_scales.typed_data(), rhs.untyped_data(), rhs_scales.typed_data(),
      group_sizes.typed_data(), s->M, s->K, s->N, s->G, out->untyped_data(), checked, &runner));
}

// `fast_accumulation` is accepted and ignored here and below: the CPU engine's sums are float32
// either way (it picks how the GPU's tensor cores keep theirs).
ffi::Error GroupedMatmulFp8Tensorwise(ffi::ThreadPool pool, ffi::AnyBuffer lhs,
                                      ffi::Buffer<ffi::F32> lhs_scale, ffi::AnyBuffer rhs,
                                      ffi::Buffer<ffi::F32> rhs_scales,
                                      ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::Result<ffi::Buffer<ffi::BF16>> out, bool checked,
                                      bool /*fast_accumulation*/) {
  auto s = decode_grouped_matmul_fp8_tensorwise(lhs, lhs_scale, rhs, rhs_scales, group_sizes,
                                                *out);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_fp8_tensorwise(
      lhs.untyped_data(), lhs_scale.typed_data(), rhs.untyped_data(), rhs_scales.typed_data(),
      group_sizes.typed_data(), s->M, s->K, s->N, s->G, out->untyped_data(), checked, &runner));
}

ffi::Error QuantizeFp8Transposed(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Buffer<ffi::F32> given_scale,
                                 ffi::Result<ffi::AnyBuffer> q_t,
                                 ffi::Result<ffi::Buffer<ffi::F32>> scale, bool checked) {
  auto call = decode_quantize_fp8_transposed(x, group_sizes, given_scale, *q_t, *scale);
  if (!call) return call.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::quantize_fp8_transposed(
      x.untyped_data(), call->dtype, group_sizes.typed_data(), call->M, call->C, call->G,
      call->given_scale, static_cast<uint8_t*>(q_t->untyped_data()), scale->typed_data(),
      checked, &runner));
}

ffi::Error TransposeFp8Codes(ffi::ThreadPool pool, ffi::AnyBuffer q,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q_t,
                             bool checked) {
  auto call = decode_transpose_fp8_codes(q, group_sizes, *q_t);
  if (!call) return call.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::transpose_fp8_codes(
      static_cast<const uint8_t*>(q.untyped_data()), group_sizes.typed_data(), call->M, call->C,
      call->G, static_cast<uint8_t*>(q_t->untyped_data()), checked, &runner));
}

ffi::Error GroupedMatmulFp8BlockwiseContract(ffi::ThreadPool pool, ffi::AnyBuffer lhs_t,
                                             ffi::Buffer<ffi::F32> lhs_scales,
                                             ffi::AnyBuffer rhs_t,
                                             ffi::Buffer<ffi::F32> rhs_scales,
                                             ffi::Buffer<ffi::S32> group_sizes,
                                             ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                             int64_t num_rows, bool checked) {
  auto s = decode_grouped_matmul_fp8_blockwise_contract(lhs_t, lhs_scales, rhs_t, rhs_scales,
                                                        group_sizes, *out, num_rows);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_fp8_blockwise_contract(
      lhs_t.untyped_data(), lhs_scales.typed_data(), rhs_t.untyped_data(),
      rhs_scales.typed_data(), group_sizes.typed_data(), s->M, s->K, s->N, s->G,
      out->untyped_data(), checked, &runner));
}

ffi::Error GroupedMatmulFp8TensorwiseContract(ffi::ThreadPool pool, ffi::AnyBuffer lhs_t,
                                              ffi::Buffer<ffi::F32> lhs_scale,
                                              ffi::AnyBuffer rhs_t,
                                              ffi::Buffer<ffi::F32> rhs_scale,
                                              ffi::Buffer<ffi::S32> group_sizes,
                                              ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                              int64_t num_rows, bool checked,
                                              bool /*fast_accumulation*/) {
  auto s = decode_grouped_matmul_fp8_tensorwise_contract(lhs_t, lhs_scale, rhs_t, rhs_scale,
                                                         group_sizes, *out, num_rows);
  if (!s) return s.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::grouped_matmul_fp8_tensorwise_contract(
      lhs_t.untyped_data(), lhs_scale.typed_data(), rhs_t.untyped_data(),
      rhs_scale.typed_data(), group_sizes.typed_data(), s->M, s->K, s->N, s->G,
      out->untyped_data(), checked, &runner));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8BlockwiseCpu, GroupedMatmulFp8Blockwise,
    bind_grouped_matmul_fp8_blockwise(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8TensorwiseCpu, GroupedMatmulFp8Tensorwise,
    bind_grouped_matmul_fp8_tensorwise(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8BlockwiseContractCpu, GroupedMatmulFp8BlockwiseContract,
    bind_grouped_matmul_fp8_blockwise_contract(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropGroupedMatmulFp8TensorwiseContractCpu, GroupedMatmulFp8TensorwiseContract,
    bind_grouped_matmul_fp8_tensorwise_contract(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8Cpu, QuantizeFp8,
                              bind_quantize_fp8(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropPermuteFp8Cpu, PermuteFp8,
                              bind_permute_fp8(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropQuantizeFp8TransposedCpu, QuantizeFp8Transposed,
    bind_quantize_fp8_transposed(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropTransposeFp8CodesCpu, TransposeFp8Codes,
    bind_transpose_fp8_codes(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropQuantizeFp8WeightsCpu, QuantizeFp8Weights<false>,
    bind_quantize_fp8_weights(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NodropQuantizeFp8WeightsTransposedCpu, QuantizeFp8Weights<true>,
    bind_quantize_fp8_weights(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers

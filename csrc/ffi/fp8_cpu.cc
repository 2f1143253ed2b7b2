// The FP8 quantisation's CPU handler, on XLA's thread pool.
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8Cpu, QuantizeFp8,
                              bind_quantize_fp8(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers

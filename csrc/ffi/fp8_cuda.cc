// The FP8 quantisation's CUDA handler; CUDA-graph compatible.
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

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropQuantizeFp8Cuda, QuantizeFp8,
                              bind_quantize_fp8(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace nodrop::handlers

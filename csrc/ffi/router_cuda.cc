// The top-k router's CUDA handlers, forward and backward; both are CUDA-graph compatible.
#include "ffi/router.h"
#include "nodrop/engine_cuda.h"

namespace nodrop::handlers {
namespace {

ffi::Error TopkRouter(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::F32> expert_bias, ffi::Result<ffi::Buffer<ffi::F32>> weights,
                      ffi::Result<ffi::Buffer<ffi::S32>> ids, RouterAttributes attributes) {
  auto config = decode_router(logits, expert_bias, *weights, *ids, attributes);
  if (!config) return config.error();
  return to_ffi_error(cuda::topk_router(logits.typed_data(), expert_bias.typed_data(), *config,
                                        weights->typed_data(), ids->typed_data(), stream));
}

ffi::Error TopkRouterGrad(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,
                          ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grad_weights,
                          ffi::Result<ffi::Buffer<ffi::F32>> grad_logits,
                          RouterAttributes attributes) {
  auto config = decode_router_grad(logits, ids, grad_weights, *grad_logits, attributes);
  if (!config) return config.error();
  return to_ffi_error(cuda::topk_router_grad(logits.typed_data(), ids.typed_data(),
                                             grad_weights.typed_data(), *config,
                                             grad_logits->typed_data(), stream));
}

}  // namespace

using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterCuda, TopkRouter,
                              bind_topk_router(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterGradCuda, TopkRouterGrad,
                              bind_topk_router_grad(ffi::Ffi::Bind().Ctx<Stream>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace nodrop::handlers

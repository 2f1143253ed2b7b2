// The top-k router's CPU handlers, forward and backward, on XLA's thread pool.
#include "ffi/router.h"
#include "ffi/xla_thread_pool.h"
#include "nodrop/engine_cpu.h"

namespace nodrop::handlers {
namespace {

ffi::Error TopkRouter(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::F32> expert_bias, ffi::Result<ffi::Buffer<ffi::F32>> weights,
                      ffi::Result<ffi::Buffer<ffi::S32>> ids, RouterAttributes attributes) {
  auto config = decode_router(logits, expert_bias, *weights, *ids, attributes);
  if (!config) return config.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::topk_router(logits.typed_data(), expert_bias.typed_data(), *config,
                                       weights->typed_data(), ids->typed_data(), &runner));
}

ffi::Error TopkRouterGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                          ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grad_weights,
                          ffi::Result<ffi::Buffer<ffi::F32>> grad_logits,
                          RouterAttributes attributes) {
  auto config = decode_router_grad(logits, ids, grad_weights, *grad_logits, attributes);
  if (!config) return config.error();
  XlaThreadPoolRunner runner(pool);
  return to_ffi_error(cpu::topk_router_grad(logits.typed_data(), ids.typed_data(),
                                            grad_weights.typed_data(), *config,
                                            grad_logits->typed_data(), &runner));
}

}  // namespace


XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterCpu, TopkRouter,
                              bind_topk_router(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterGradCpu, TopkRouterGrad,
                              bind_topk_router_grad(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace nodrop::handlers

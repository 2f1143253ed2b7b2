// FFI handlers of the top-k router, forward and backward; compiled for the CPU library and, with
// NODROP_WITH_CUDA, for the CUDA library.
#include <string_view>

#include "ffi/common.h"

#ifdef NODROP_WITH_CUDA
#include "nodrop/engine_cuda_moe.h"
#endif

namespace nodrop::ffi_glue {
namespace {

ffi::ErrorOr<RouterConfig> router_config(int64_t num_tokens, int64_t num_experts, int64_t k,
                                         std::string_view score_function, int64_t num_groups,
                                         int64_t topk_groups, bool renormalize,
                                         float scaling_factor) {
  RouterConfig c;
  c.num_tokens = num_tokens;
  c.num_experts = num_experts;
  c.k = k;
  if (score_function == "softmax") {
    c.score_function = ScoreFunction::kSoftmax;
  } else if (score_function == "sigmoid") {
    c.score_function = ScoreFunction::kSigmoid;
  } else {
    return ffi::Error::InvalidArgument("score_function must be \"softmax\" or \"sigmoid\", got \"" +
                                       std::string(score_function) + "\"");
  }
  c.num_groups = num_groups;
  c.topk_groups = topk_groups;
  c.renormalize = renormalize;
  c.scaling_factor = scaling_factor;
  Status status = validate_router_config(c);
  if (!status.ok()) return to_ffi_error(status);
  return c;
}

// logits [T, E], expert_bias [E] -> weights [T, k], ids [T, k].
ffi::ErrorOr<RouterConfig> decode_router(const ffi::Buffer<ffi::F32>& logits,
                                         const ffi::Buffer<ffi::F32>& expert_bias,
                                         const ffi::Buffer<ffi::F32>& weights,
                                         const ffi::Buffer<ffi::S32>& ids, int64_t k,
                                         std::string_view score_function, int64_t num_groups,
                                         int64_t topk_groups, bool renormalize,
                                         float scaling_factor) {
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("expert_bias", expert_bias, 1));
  NODROP_RETURN_IF_ERROR(require_dim("expert_bias", expert_bias, 0, E));
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 1, k));
  return router_config(T, E, k, score_function, num_groups, topk_groups, renormalize,
                       scaling_factor);
}

// logits [T, E], ids [T, k], grad_weights [T, k] -> grad_logits [T, E].
ffi::ErrorOr<RouterConfig> decode_router_grad(const ffi::Buffer<ffi::F32>& logits,
                                              const ffi::Buffer<ffi::S32>& ids,
                                              const ffi::Buffer<ffi::F32>& grad_weights,
                                              const ffi::Buffer<ffi::F32>& grad_logits, int64_t k,
                                              std::string_view score_function, int64_t num_groups,
                                              int64_t topk_groups, bool renormalize,
                                              float scaling_factor) {
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("ids", ids, 2));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 1, k));
  NODROP_RETURN_IF_ERROR(require_rank("grad_weights", grad_weights, 2));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", grad_logits, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", grad_logits, 1, E));
  return router_config(T, E, k, score_function, num_groups, topk_groups, renormalize,
                       scaling_factor);
}

#ifndef NODROP_WITH_CUDA
using Context = ffi::ThreadPool;
#else
using Context = cudaStream_t;
#endif

ffi::Error TopkRouter(Context context, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::F32> expert_bias, ffi::Result<ffi::Buffer<ffi::F32>> weights,
                      ffi::Result<ffi::Buffer<ffi::S32>> ids, int64_t k,
                      std::string_view score_function, int64_t num_groups, int64_t topk_groups,
                      bool renormalize, float scaling_factor) {
  auto config = decode_router(logits, expert_bias, *weights, *ids, k, score_function, num_groups,
                              topk_groups, renormalize, scaling_factor);
  if (!config) return config.error();
#ifndef NODROP_WITH_CUDA
  XlaThreadPoolRunner runner(context);
  return to_ffi_error(cpu::topk_router(logits.typed_data(), expert_bias.typed_data(), *config,
                                       weights->typed_data(), ids->typed_data(), &runner));
#else
  return to_ffi_error(cuda::topk_router(logits.typed_data(), expert_bias.typed_data(), *config,
                                        weights->typed_data(), ids->typed_data(), context));
#endif
}

ffi::Error TopkRouterGrad(Context context, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> grad_weights,
                          ffi::Result<ffi::Buffer<ffi::F32>> grad_logits, int64_t k,
                          std::string_view score_function, int64_t num_groups,
                          int64_t topk_groups, bool renormalize, float scaling_factor) {
  auto config = decode_router_grad(logits, ids, grad_weights, *grad_logits, k, score_function,
                                   num_groups, topk_groups, renormalize, scaling_factor);
  if (!config) return config.error();
#ifndef NODROP_WITH_CUDA
  XlaThreadPoolRunner runner(context);
  return to_ffi_error(cpu::topk_router_grad(logits.typed_data(), ids.typed_data(),
                                            grad_weights.typed_data(), *config,
                                            grad_logits->typed_data(), &runner));
#else
  return to_ffi_error(cuda::topk_router_grad(logits.typed_data(), ids.typed_data(),
                                             grad_weights.typed_data(), *config,
                                             grad_logits->typed_data(), context));
#endif
}

}  // namespace
}  // namespace nodrop::ffi_glue

namespace ffi = xla::ffi;

#define NODROP_ROUTER_ATTRS                    \
  .Attr<int64_t>("k")                          \
      .Attr<std::string_view>("score_function") \
      .Attr<int64_t>("num_groups")             \
      .Attr<int64_t>("topk_groups")            \
      .Attr<bool>("renormalize")               \
      .Attr<float>("scaling_factor")

#ifndef NODROP_WITH_CUDA

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterCpu, nodrop::ffi_glue::TopkRouter,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>() NODROP_ROUTER_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterGradCpu, nodrop::ffi_glue::TopkRouterGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() NODROP_ROUTER_ATTRS);

#else

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterCuda, nodrop::ffi_glue::TopkRouter,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>() NODROP_ROUTER_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterGradCuda, nodrop::ffi_glue::TopkRouterGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() NODROP_ROUTER_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

#endif

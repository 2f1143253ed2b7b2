// FFI handlers of the top-k router, forward and backward.
#include <string_view>

#include "ffi/common.h"

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
ffi::Error TopkRouterCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> expert_bias,
                         ffi::Result<ffi::Buffer<ffi::F32>> weights,
                         ffi::Result<ffi::Buffer<ffi::S32>> ids, int64_t k,
                         std::string_view score_function, int64_t num_groups, int64_t topk_groups,
                         bool renormalize, float scaling_factor) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("expert_bias", expert_bias, 1));
  NODROP_RETURN_IF_ERROR(require_dim("expert_bias", expert_bias, 0, E));
  NODROP_RETURN_IF_ERROR(require_dim("weights", *weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("weights", *weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("ids", *ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", *ids, 1, k));
  auto config = router_config(T, E, k, score_function, num_groups, topk_groups, renormalize,
                              scaling_factor);
  if (!config) return config.error();
  return to_ffi_error(cpu::topk_router(logits.typed_data(), expert_bias.typed_data(), *config,
                                       weights->typed_data(), ids->typed_data(), &runner));
}

// logits [T, E], ids [T, k], grad_weights [T, k] -> grad_logits [T, E].
ffi::Error TopkRouterGradCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> ids,
                             ffi::Buffer<ffi::F32> grad_weights,
                             ffi::Result<ffi::Buffer<ffi::F32>> grad_logits, int64_t k,
                             std::string_view score_function, int64_t num_groups,
                             int64_t topk_groups, bool renormalize, float scaling_factor) {
  XlaThreadPoolRunner runner(pool);
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1];
  NODROP_RETURN_IF_ERROR(require_rank("ids", ids, 2));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 1, k));
  NODROP_RETURN_IF_ERROR(require_rank("grad_weights", grad_weights, 2));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", *grad_logits, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", *grad_logits, 1, E));
  auto config = router_config(T, E, k, score_function, num_groups, topk_groups, renormalize,
                              scaling_factor);
  if (!config) return config.error();
  return to_ffi_error(cpu::topk_router_grad(logits.typed_data(), ids.typed_data(),
                                            grad_weights.typed_data(), *config,
                                            grad_logits->typed_data(), &runner));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterCpu, nodrop::ffi_glue::TopkRouterCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>() NODROP_ROUTER_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(NodropTopkRouterGradCpu, nodrop::ffi_glue::TopkRouterGradCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() NODROP_ROUTER_ATTRS);

// Decoding and validation of the top-k router's handlers (router_cpu.cc, router_cuda.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "ffi/common.h"

namespace nodrop::handlers {

// The router's attributes, which XLA decodes into one struct (by these names).
struct RouterAttributes {
  int64_t k;
  std::string_view score_function;
  int64_t num_groups;
  int64_t topk_groups;
  bool renormalize;
  float scaling_factor;
};

// The engine's RouterConfig for T tokens and E experts, or an error naming the bad attribute.
inline ffi::ErrorOr<RouterConfig> router_config(int64_t T, int64_t E, const RouterAttributes& a) {
  RouterConfig c;
  c.num_tokens = T;
  c.num_experts = E;
  c.k = a.k;
  if (a.score_function == "softmax") {
    c.score_function = ScoreFunction::kSoftmax;
  } else if (a.score_function == "sigmoid") {
    c.score_function = ScoreFunction::kSigmoid;
  } else {
    return ffi::Error::InvalidArgument("score_function must be \"softmax\" or \"sigmoid\", got \"" +
                                       std::string(a.score_function) + "\"");
  }
  c.num_groups = a.num_groups;
  c.topk_groups = a.topk_groups;
  c.renormalize = a.renormalize;
  c.scaling_factor = a.scaling_factor;
  Status status = validate_router_config(c);
  if (!status.ok()) return to_ffi_error(status);
  return c;
}

// logits [T, E], expert_bias [E] -> weights [T, k], ids [T, k].
inline ffi::ErrorOr<RouterConfig> decode_router(const ffi::Buffer<ffi::F32>& logits,
                                                const ffi::Buffer<ffi::F32>& expert_bias,
                                                const ffi::Buffer<ffi::F32>& weights,
                                                const ffi::Buffer<ffi::S32>& ids,
                                                const RouterAttributes& attributes) {
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1], k = attributes.k;
  NODROP_RETURN_IF_ERROR(require_rank("expert_bias", expert_bias, 1));
  NODROP_RETURN_IF_ERROR(require_dim("expert_bias", expert_bias, 0, E));
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("weights", weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 1, k));
  return router_config(T, E, attributes);
}

// logits [T, E], ids [T, k], grad_weights [T, k] -> grad_logits [T, E].
inline ffi::ErrorOr<RouterConfig> decode_router_grad(const ffi::Buffer<ffi::F32>& logits,
                                                     const ffi::Buffer<ffi::S32>& ids,
                                                     const ffi::Buffer<ffi::F32>& grad_weights,
                                                     const ffi::Buffer<ffi::F32>& grad_logits,
                                                     const RouterAttributes& attributes) {
  NODROP_RETURN_IF_ERROR(require_rank("logits", logits, 2));
  const int64_t T = logits.dimensions()[0], E = logits.dimensions()[1], k = attributes.k;
  NODROP_RETURN_IF_ERROR(require_rank("ids", ids, 2));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("ids", ids, 1, k));
  NODROP_RETURN_IF_ERROR(require_rank("grad_weights", grad_weights, 2));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_weights", grad_weights, 1, k));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", grad_logits, 0, T));
  NODROP_RETURN_IF_ERROR(require_dim("grad_logits", grad_logits, 1, E));
  return router_config(T, E, attributes);
}

// The operands after the platform's context: logits, expert_bias -> weights, ids.
template <typename Binding>
auto bind_topk_router(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attrs<RouterAttributes>();
}

// logits, ids, grad_weights -> grad_logits.
template <typename Binding>
auto bind_topk_router_grad(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attrs<RouterAttributes>();
}

}  // namespace nodrop::handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(nodrop::handlers::RouterAttributes,
                                      StructMember<int64_t>("k"),
                                      StructMember<std::string_view>("score_function"),
                                      StructMember<int64_t>("num_groups"),
                                      StructMember<int64_t>("topk_groups"),
                                      StructMember<bool>("renormalize"),
                                      StructMember<float>("scaling_factor"));

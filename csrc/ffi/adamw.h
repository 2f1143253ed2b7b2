// Decoding and validation of the AdamW step's handlers (adamw_cpu.cc, adamw_cuda.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "ffi/common.h"

namespace nodrop::handlers {

// The step's constant hyperparameters, which XLA decodes into one struct (by these names).
struct AdamWAttributes {
  float b1;
  float b2;
  float eps;
  float weight_decay;
  float update_scale;
  float max_grad_norm;
};

// param, grad, mu, nu (one shape, any rank; grad float32, bfloat16 or float16, the rest float32),
// scalars [4] -> param, mu, nu (that shape), partials [P, kAdamWSums]: the engine's AdamWConfig,
// or an error naming the argument.
inline ffi::ErrorOr<AdamWConfig> decode_adamw(const ffi::Buffer<ffi::F32>& param,
                                              const ffi::AnyBuffer& grad,
                                              const ffi::Buffer<ffi::F32>& mu,
                                              const ffi::Buffer<ffi::F32>& nu,
                                              const ffi::Buffer<ffi::F32>& scalars,
                                              const ffi::Buffer<ffi::F32>& param_out,
                                              const ffi::Buffer<ffi::F32>& mu_out,
                                              const ffi::Buffer<ffi::F32>& nu_out,
                                              const ffi::Buffer<ffi::F32>& partials,
                                              const AdamWAttributes& a) {
  const auto shape = param.dimensions();
  auto same_shape = [&](const char* name, const auto& buffer) {
    const auto dims = buffer.dimensions();
    if (dims.size() == shape.size() && std::equal(dims.begin(), dims.end(), shape.begin())) {
      return ffi::Error::Success();
    }
    return ffi::Error::InvalidArgument(std::string(name) + " has shape " + shape_string(dims) +
                                       " but param has " + shape_string(shape));
  };
  NODROP_RETURN_IF_ERROR(same_shape("grad", grad));
  if (auto dtype = require_float("grad", grad); !dtype) return dtype.error();
  NODROP_RETURN_IF_ERROR(same_shape("mu", mu));
  NODROP_RETURN_IF_ERROR(same_shape("nu", nu));
  NODROP_RETURN_IF_ERROR(same_shape("param_out", param_out));
  NODROP_RETURN_IF_ERROR(same_shape("mu_out", mu_out));
  NODROP_RETURN_IF_ERROR(same_shape("nu_out", nu_out));
  NODROP_RETURN_IF_ERROR(require_rank("scalars", scalars, 1));
  NODROP_RETURN_IF_ERROR(require_dim("scalars", scalars, 0, 4));
  NODROP_RETURN_IF_ERROR(require_rank("partials", partials, 2));
  NODROP_RETURN_IF_ERROR(require_dim("partials", partials, 1, kAdamWSums));
  AdamWConfig c;
  c.num_elements = static_cast<int64_t>(param.element_count());
  c.num_partials = partials.dimensions()[0];
  c.b1 = a.b1;
  c.b2 = a.b2;
  c.eps = a.eps;
  c.weight_decay = a.weight_decay;
  c.update_scale = a.update_scale;
  c.max_grad_norm = a.max_grad_norm;
  Status status = validate_adamw_config(c);
  if (!status.ok()) return to_ffi_error(status);
  return c;
}

// The operands after the platform's context: param, grad, mu, nu, scalars -> param, mu, nu,
// partials.
template <typename Binding>
auto bind_adamw(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attrs<AdamWAttributes>();
}

}  // namespace nodrop::handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(nodrop::handlers::AdamWAttributes,
                                      StructMember<float>("b1"), StructMember<float>("b2"),
                                      StructMember<float>("eps"),
                                      StructMember<float>("weight_decay"),
                                      StructMember<float>("update_scale"),
                                      StructMember<float>("max_grad_norm"));
